"""ServerConfig: the HTTP side's frozen settings (the engine's live in EngineConfig). Built by cli.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from outrider import __version__
from outrider.params import SamplingParams

# Reported as /props.build_info and OpenAI `system_fingerprint`: "b<build>-<id>" like llama-server.
BUILD_INFO = f"b10621-outrider-{__version__}"


def default_params(**fields) -> SamplingParams:
    """llama-server's request defaults: no token limit, prompt caching on."""
    return SamplingParams(**{"max_tokens": -1, **fields})


@dataclass(frozen=True)
class ServerConfig:
    model_name: str  # what /v1/models reports when no --alias is given
    aliases: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()
    endpoint_metrics: bool = False
    endpoint_slots: bool = True
    endpoint_props: bool = False
    webui: bool = True  # the built-in page at / (server/webui)
    timeout: float = 3600.0  # idle keep-alive of a connection, seconds
    sse_ping_interval: float = 30.0  # seconds of stream silence before a `:` keep-alive comment; <= 0 = off
    max_body_bytes: int = 32 << 20
    max_queue: int = 256  # requests that may wait for a slot; more get 503 "All slots are busy"
    slots_debug: bool = False  # /slots shows prompts, generated text and stop words (LLAMA_SERVER_SLOTS_DEBUG)
    shutdown_timeout: float = 30.0  # seconds requests in flight may run on after SIGTERM/SIGINT
    exit_on_engine_failure: bool = True  # a dead engine ends the process (status 1) so a supervisor restarts it
    stall_timeout: float = 60.0  # /health is 503 after this long without an engine turn while work waits; 0 = off
    # Request defaults (cache_prompt included).
    defaults: SamplingParams = field(default_factory=lambda: default_params())
    # CORS allow-list: "*" (any origin), "localhost" (loopback origins on any port), or exact origins.
    cors_origins: tuple[str, ...] = ("*",)
    tags: tuple[str, ...] = ()  # /models lists them
    prefill_assistant: bool = True  # a final assistant message is continued, not closed (chat routes)
    verbose: bool = False  # -v: debug logs, and every response carries `__verbose`
    log_disable: bool = False
    log_file: str | None = None
    # Chat: --reasoning-format, --chat-template-kwargs (under each request's own), --jinja (off: no tools)
    reasoning_format: str = "auto"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    jinja: bool = True
    # --embedding serves the embedding routes; --pooling (None: the model's pooling config, else mean)
    embeddings: bool = False
    context_shift: bool = False  # a request that fills its context goes on shifted (server/context_shift.py)
    pooling: str | None = None

    @property
    def model_alias(self) -> str:
        """llama-server reports the alphabetically first alias as the model id."""
        return min(self.aliases) if self.aliases else self.model_name
