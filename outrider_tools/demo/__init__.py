"""The bundled demo family's trainer (outrider/demo): profiles (sizes and settings), tokenizer and corpus (the
data), models (outrider's modules built, written and loaded), objectives and training (what and how each stage
learns), proxy (the offline acceptance simulation) and train (the stages, `scripts/train_demo.py`)."""
