"""Random LoRA adapters, direct (server-free) reference generation for a local base model, and the
server app on a real socket in-process.

Tests, benchmarks and demos use these to make adapters that visibly change outputs without
training, and to compute what the server must return for a given adapter.
"""

from __future__ import annotations

from pathlib import Path


def make_random_adapter(
    base_model: str | Path,
    out_dir: str | Path,
    *,
    seed: int,
    rank: int = 4,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    scale: float = 1.0,
) -> Path:
    """Save a LoRA adapter with random non-zero A and B (``scale`` sets B's std, so outputs change)
    as a peft directory holding ``adapter_config.json`` and ``adapter_model.safetensors``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_model))
    cfg = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(target_modules), init_lora_weights=False)
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def train_memorising_model(
    base_model: str | Path,
    out_dir: str | Path,
    prompt_ids: list[int],
    target_ids: list[int],
    *,
    max_steps: int = 300,
    lr: float = 3e-3,
    seed: int = 0,
) -> Path:
    """Fine-tune a copy of a (tiny) base model until greedy decoding of ``prompt_ids`` gives
    ``target_ids`` exactly, and save it (weights and tokenizer) as a model directory: a model that
    writes what a test needs, e.g. a tool call, through the real sampling path. All weights are
    trained (a LoRA on a random tiny model cannot move its tied embeddings far enough). Raises if
    it has not memorised the target within ``max_steps`` Adam steps."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ids, n = torch.tensor([list(prompt_ids) + list(target_ids)]), len(prompt_ids)
    for step in range(max_steps):
        opt.zero_grad()
        logits = model(input_ids=ids).logits[0, n - 1 : -1]  # [len(target), V]: each target token's prediction
        loss = torch.nn.functional.cross_entropy(logits, ids[0, n:])
        # Done when greedy gives the target with a margin (a low loss), so batching noise cannot flip a token.
        if float(loss.detach()) < 0.01 and torch.equal(logits.argmax(-1), ids[0, n:]):
            break
        loss.backward()
        opt.step()
    else:
        raise RuntimeError(f"the model did not memorise its target in {max_steps} steps")
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(base_model)).save_pretrained(out_dir)
    return out_dir


class DirectModel:
    """The base model with one adapter (or none), run without the server: the reference that
    served outputs and log-probs must equal."""

    def __init__(self, base_model: str | Path, adapter_dir: str | Path | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(base_model))
        model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter_dir))
        self.model = model.eval()

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        kwargs = {"tools": tools} if tools else {}
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       **kwargs)["input_ids"])

    def logprobs(self, prompt_ids: list[int], token_ids: list[int], temperature: float = 1.0):
        """``[len(token_ids), vocab]`` log-softmax(logits / T) at each generated position."""
        import torch

        ids = torch.tensor([list(prompt_ids) + list(token_ids)])
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0].float()
        return (logits[len(prompt_ids) - 1 : -1] / temperature).log_softmax(-1)

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Greedy continuation by full forward passes (no cache, no padding)."""
        import torch

        ids = list(prompt_ids)
        eos = self.tokenizer.eos_token_id
        with torch.no_grad():
            for _ in range(max_tokens):
                tok = int(self.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                ids.append(tok)
                if tok == eos:
                    break
        return ids[len(prompt_ids) :]


class AppServer:
    """The server app of an in-process engine on a real socket (uvicorn in a thread, 127.0.0.1, a free
    port): for tests that need to reach into the engine while clients talk HTTP to it."""

    def __init__(self, app):
        import uvicorn

        from .process import free_port

        self.port = free_port()
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> AppServer:
        import threading
        import time

        self._thread = threading.Thread(target=self._server.run, name="marft-test-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
