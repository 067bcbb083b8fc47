"""The demo family's training text. Every `.py` file of the running interpreter's standard library (site-packages
excluded): a fixed 5 % of the files, chosen by a hash of their relative path, is held out for evaluation and never
trained on; the tokenizer learns from the rest. The training text adds chat examples built from documented
functions and methods, and, up to a cap, the `.py` files of the interpreter's installed packages, less duplicates
and copies of the stdlib."""

from __future__ import annotations

import ast
import hashlib
import platform
import random
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from outrider_tools.demo.profiles import Profile
from outrider_tools.demo.tokenizer import encode_stream, train_tokenizer

def stdlib_files(root: Path, max_files: int | None, max_bytes: int) -> list[tuple[str, str]]:
    """(relative path, text) of every UTF-8 .py file under the stdlib, site-packages excluded, sorted."""
    paths = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not ("site-packages" in rel or "dist-packages" in rel or "__pycache__" in rel):
            try:
                if path.stat().st_size <= max_bytes:
                    paths.append((rel, path))
            except OSError:
                continue
    if max_files is not None:  # smoke: a deterministic spread of the files, a few of them held out
        held = [f for f in paths if is_held_out(f[0])]
        kept = [f for f in paths if not is_held_out(f[0])]
        paths = sorted(kept[:: max(1, len(kept) // max_files)][:max_files] +
                       held[:: max(1, len(held) // 4)][: max(2, max_files // 10)])
    out = []
    for rel, path in paths:
        try:
            data = path.read_bytes()
            if not data.strip():
                continue
            out.append((rel, data.decode("utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    return out


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20 == 0


def site_dirs() -> list[Path]:
    """This interpreter's package directories: the site-packages / dist-packages entries of sys.path."""
    return sorted({Path(e).resolve() for e in sys.path
                   if Path(e).name in ("site-packages", "dist-packages") and Path(e).is_dir()})


# A line counts toward the stdlib-copy test when it is this long once stripped: short lines (`return x`, `else:`)
# occur in any Python file.
DISTINCTIVE_LINE = 30


GENERATED_LINE = 1000  # a file with a longer line is generated data (tables, blobs), not code to learn from


@dataclass(frozen=True)
class PackageCorpus:
    """Training-only source from installed packages. files: (root index:relative path, text) in the order taken."""
    files: list
    cap_bytes: int
    skipped_duplicates: int  # the same text as an earlier package file or as a stdlib file
    skipped_stdlib_copies: int  # half or more of its distinctive lines occur in the stdlib (backports, vendoring)
    skipped_generated: int


def package_files(roots: list[Path], stdlib: list[tuple[str, str]], cap_bytes: int,
                  max_bytes: int) -> PackageCorpus:
    """UTF-8 .py files under `roots`, taken in a fixed pseudo-random order (sha1 of the root-relative path, so no
    one package crowds out the rest) until their text reaches `cap_bytes`. Left out: files over `max_bytes`,
    generated files, exact duplicates, and copies of the stdlib, so that nothing held out leaks in through a
    backport or a vendored module."""
    candidates = []
    for index, root in enumerate(roots):
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" not in rel:
                candidates.append((hashlib.sha1(rel.encode()).digest(), index, rel, path))
    candidates.sort(key=lambda c: c[:3])
    seen = {hashlib.sha256(text.encode()).digest() for _, text in stdlib}
    stdlib_lines = {line for _, text in stdlib for line in distinctive_lines(text)}
    files, total, duplicates, copies, generated = [], 0, 0, 0, 0
    for _, index, rel, path in candidates:
        try:
            if path.stat().st_size > max_bytes:
                continue
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        digest = hashlib.sha256(text.encode()).digest()
        lines = distinctive_lines(text)
        if digest in seen:
            duplicates += 1
        elif lines and 2 * sum(line in stdlib_lines for line in lines) >= len(lines):
            copies += 1
        elif any(len(line) > GENERATED_LINE for line in text.splitlines()):
            generated += 1
        elif total + len(text.encode()) > cap_bytes:
            break
        else:
            seen.add(digest)
            files.append((f"{index}:{rel}", text))
            total += len(text.encode())
    return PackageCorpus(files, cap_bytes, duplicates, copies, generated)


def distinctive_lines(text: str) -> list[str]:
    return [s for s in (line.strip() for line in text.splitlines()) if len(s) >= DISTINCTIVE_LINE]


def fingerprint(files: list[tuple[str, str]]) -> str:
    fp = hashlib.sha256()
    for rel, text in files:
        fp.update(rel.encode() + b"\0" + text.encode() + b"\0")
    return fp.hexdigest()


@dataclass(frozen=True)
class CodeRequest:
    """A request for a documented function or method, by signature and the first docstring line, and its source."""
    ask: str
    source: str  # dedented


def code_requests(files: list[tuple[str, str]], methods: bool = False) -> list[CodeRequest]:
    """One CodeRequest per documented public top-level function of `files` (or, with methods, per documented
    public method of their public top-level classes) of at most 1500 characters, in file order."""
    out = []
    for rel, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = SOURCE_LINE.findall(text)
        for owner, node in documented_defs(tree, methods):
            doc = ast.get_docstring(node)
            src = source_segment(lines, node)
            if not doc or not doc.strip() or not src or len(src) > 1500:
                continue
            summary = doc.strip().splitlines()[0].strip()
            if len(summary) < 8:
                continue
            args = ast.unparse(node.args)
            ask = (f"Write the method `{owner}.{node.name}({args})`: {summary}" if owner else
                   f"Write a Python function `{node.name}({args})`: {summary}")
            out.append(CodeRequest(ask, textwrap.dedent(src)))
    return out


# A line as the ast module splits source: ended by \r\n, \r or \n (str.splitlines would also split at \f and others)
SOURCE_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


def source_segment(lines: list[str], node: ast.AST) -> str:
    """ast.get_source_segment(text, node, padded=True) over SOURCE_LINE.findall(text), split once per file (the ast
    function splits the whole text again at every call, in pure Python). Padded: a method's first line keeps its
    indent."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset:node.end_col_offset].decode()
    head = lines[first].encode()
    pad = "".join(c if c in "\f\t" else " " for c in head[:node.col_offset].decode())
    return "".join([pad + head[node.col_offset:].decode(), *lines[first + 1:last],
                    lines[last].encode()[:node.end_col_offset].decode()])


def chat_examples(files: list[tuple[str, str]], limit: int, seed: int, methods: bool = False) -> list[str]:
    """ChatML documents from code_requests: the ask, answered with the source in a code fence. Shuffled by the
    seed, the first `limit` kept."""
    out = [f"<|im_start|>user\n{r.ask}<|im_end|>\n<|im_start|>assistant\n```python\n{r.source}\n```<|im_end|>\n"
           for r in code_requests(files, methods)]
    rng = random.Random(seed + (1 if methods else 0))
    rng.shuffle(out)
    return out[:limit]


def documented_defs(tree: ast.Module, methods: bool):
    """(owner class name or "", FunctionDef) of the public top-level functions, or of the public methods of the
    public top-level classes."""
    for node in tree.body:
        if methods and isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from ((node.name, m) for m in node.body
                        if isinstance(m, ast.FunctionDef) and not m.name.startswith("_"))
        elif not methods and isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            yield "", node


@dataclass(frozen=True)
class Corpus:
    """The stdlib split into training and held-out files, the training-only extras, the tokenizer and the
    encoded streams. Adding package files changes neither the held-out stream nor the tokenizer."""
    root: Path
    files: list  # every stdlib (relative path, text), sorted
    train_files: list
    held_files: list
    chats: list
    method_chats: list
    package_roots: list
    packages: PackageCorpus
    tok: object
    train_stream: torch.Tensor
    val_stream: torch.Tensor

    def summary(self) -> dict:
        """metrics.json -> corpus."""
        held_bytes = sum(len(t.encode()) for _, t in self.held_files)
        return {
            "root": str(self.root), "python": platform.python_version(), "files": len(self.files),
            "train_files": len(self.train_files), "held_out_files": len(self.held_files),
            "bytes": sum(len(t.encode()) for _, t in self.files), "sha256": fingerprint(self.files),
            "chat_examples": len(self.chats), "method_chat_examples": len(self.method_chats),
            "train_tokens": len(self.train_stream), "held_out_tokens": len(self.val_stream),
            "held_out_bytes_per_token": round(held_bytes / max(1, len(self.val_stream) - len(self.held_files)), 3),
            "packages": {"what": "training only: .py files of installed packages (never held out, not in the "
                                 "tokenizer's text); a file is named 'index of its root:path under the root'",
                         "roots": [str(r) for r in self.package_roots], "cap_bytes": self.packages.cap_bytes,
                         "files": len(self.packages.files),
                         "bytes": sum(len(t.encode()) for _, t in self.packages.files),
                         "sha256": fingerprint(self.packages.files),
                         "skipped_duplicates": self.packages.skipped_duplicates,
                         "skipped_stdlib_copies": self.packages.skipped_stdlib_copies,
                         "skipped_generated": self.packages.skipped_generated},
        }


def build_corpus(root: Path, package_roots: list[Path], p: Profile, seed: int, tok=None) -> Corpus:
    """tok: a tokenizer to encode with (an existing family's) instead of training one."""
    files = stdlib_files(root, p.max_files, p.max_file_bytes)
    train_files = [f for f in files if not is_held_out(f[0])]
    held_files = [f for f in files if is_held_out(f[0])]
    chats = chat_examples(train_files, p.max_chat, seed)
    method_chats = chat_examples(train_files, p.max_chat, seed, methods=True)
    packages = package_files(package_roots, files, p.package_bytes, p.max_file_bytes)
    train_docs = [t for _, t in train_files] + chats + method_chats + [t for _, t in packages.files]
    random.Random(seed).shuffle(train_docs)
    # The tokenizer learns from the same text as the first published family's (no method examples, no packages),
    # so it is the same tokenizer and held-out losses per token compare directly across families.
    tok = tok or train_tokenizer([t for _, t in train_files] + chats, p.vocab)
    return Corpus(root, files, train_files, held_files, chats, method_chats, list(package_roots), packages, tok,
                  encode_stream(tok, train_docs), encode_stream(tok, [t for _, t in held_files]))


def sample_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `length` tokens (offsets drawn on the CPU generator, so runs are seeded)."""
    starts = torch.randint(0, len(stream) - length, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(length)[None]
    return stream[idx.to(stream.device)].long()


def fixed_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    n = min(count, len(stream) // length)
    return stream[: n * length].view(n, length).long()

