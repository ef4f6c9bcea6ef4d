"""Shared by the serving tests: a tiny random model on the 512-entry Shakespeare tokenizer (and saved as a
checkpoint beside a tokenizer), a uvicorn server on a free loopback port in a background thread, and the two with
the openai client on them."""

from __future__ import annotations

import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from dist_helpers import free_port
from model_helpers import tiny_model
from zaya.model import ZayaForCausalLM


def served_model(vocab_size: int = 512, max_seq_len: int = 128, seed: int = 0) -> ZayaForCausalLM:
    """The tiny model on the 512-entry tokenizer's ids (eos 2), in eval mode and moved away from its init, so that
    tokens differ from position to position."""
    model = tiny_model(seed, vocab_size=vocab_size, max_seq_len=max_seq_len, eos_token_id=2, hidden_size=64,
                       num_layers=2, expert_hidden_size=64).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def served_checkpoint(directory: Path, tokenizer: Path, max_seq_len: int = 128) -> Path:
    """``served_model`` saved as a zaya checkpoint in ``directory``, with a copy of ``tokenizer`` beside it listed in
    its SHA256SUMS (a file the manifest does not list is refused at load)."""
    from zaya.model.checksums import write_checksums
    from zaya.model.io import save_checkpoint

    save_checkpoint(served_model(max_seq_len=max_seq_len), directory)
    shutil.copy(tokenizer, Path(directory) / "tokenizer.json")
    write_checksums(directory)
    return Path(directory)


class ServerThread:
    """``with ServerThread(app) as base_url:`` runs uvicorn on 127.0.0.1:<free port> until the block ends."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def post_json(url: str, body, key: str | None = None, timeout: float = 30, **kwargs):
    """POST ``body`` as JSON (non-ASCII escaped, so a lone surrogate travels as the valid JSON ``"\\ud800"``)."""
    import json

    import httpx

    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(url, content=json.dumps(body).encode(), headers=headers, timeout=timeout, **kwargs)


@contextmanager
def openai_server(tokenizer_file: Path, vocab_size: int = 512, capacity: int = 128, num_slots: int = 4):
    """``with openai_server(...) as (tokenizer, engine, client):`` ``served_model`` behind ``build_app`` on a
    ``ServerThread``, and the official ``openai`` client on it (model name "tiny", no retries)."""
    import openai

    from zaya.data.tokenizer import Tokenizer
    from zaya.serve.engine import Engine
    from zaya.serve.server import build_app

    tok = Tokenizer.from_file(tokenizer_file)
    engine = Engine(served_model(vocab_size=vocab_size, max_seq_len=capacity), num_slots=num_slots,
                    capacity=capacity, decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    with ServerThread(build_app(engine, tok, model_name="tiny")) as url:
        yield tok, engine, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
