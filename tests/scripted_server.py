"""`k2jax serve` with a scripted model, for tests: the real server (its flags, HTTP API, engine, scheduler,
detokenizer and output parsers) with the engine's runner replaced by one that emits fixed token sequences.

    python -m tests.scripted_server --scripts FILE [--record FILE] SERVE-ARGS...

--scripts: a JSON object {"SEED": "text, special tokens by name", ...}. A request row whose sampling seed
(the request's `seed`, or choice i's derived seed, taken modulo 2**32 as the engine does) has a script
emits that text's tokens (tokenized with allow_special=True), one per step, then <|im_end|>; a row with no
script emits <|im_end|> at once.
--fail-seed N: a step that feeds a row of seed N raises (a failed step: the engine stops, the server exits 1).
--record: every request's whole prompt, as the engine feeds it, is appended as a JSON line {"seed", "prompt"}
when its prefill completes (serve with --no-prefix-cache so that no prompt token comes from the cache).
SERVE-ARGS are `k2jax serve`'s; --tokenizer DIR is required (--hf-checkpoint / --checkpoint / --demo is
not read: the model is configs/tiny.json's shape with vocab 1024, its weights unused). Nothing compiles.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


class ScriptedRunner:
    """Stands in for k2jax.runtime.runner.Runner (same constructor and step contract)."""

    scripts: dict[int, list[int]] = {}
    end_id: int = 0
    fail_seed: int | None = None
    record: Path | None = None

    def __init__(self, model, params, *, slots, num_pages, page_size, kv_dtype=None, mesh=None):
        self.cfg, self.slots = model.cfg, slots
        self.kv_dtype = "float32"
        self.extra_bytes = 0  # no per-layer expert copies
        self.state = {"pages": np.zeros((num_pages, page_size), np.float32), "scales": np.zeros(1, np.float32)}
        self._prompts: dict[int, list[int]] = {}  # slot -> the prompt ids seen so far
        self._seeds = [0] * slots  # slot -> its request's seed (set_sampling)

    def compile(self, shapes, on_progress=None, on_start=None) -> float:
        return 0.0

    def neutral_mask(self, shape):
        return None

    def set_sampling(self, settings) -> None:
        for slot, kw in settings.items():
            self._seeds[slot] = kw.get("seed", 0)

    def step(self, shape, batch) -> dict:
        import jax.numpy as jnp

        B = shape.rows
        tokens = np.zeros(B, np.int32)
        for b in range(B):
            slot = b if hasattr(batch, "row") else int(batch.slot[b])
            seed, step = self._seeds[slot], int(batch.step[b])
            if seed == self.fail_seed and int(batch.count[b]) > 0:
                raise RuntimeError(f"scripted failure: a row of seed {seed}")
            script = self.scripts.get(seed, [])
            tokens[b] = script[step] if step < len(script) else self.end_id
            self._record(b, batch, seed)
        return {"tokens": jnp.asarray(tokens), "logprob": jnp.zeros(B, jnp.float32),
                "top_ids": jnp.full((B, 20), -1, jnp.int32), "top_logprobs": jnp.zeros((B, 20), jnp.float32)}

    def send(self, shape, batch):
        """A step with grammar rows (Runner.send, then sample): the scripts need no mask."""
        return self.step(shape, batch)

    def sample(self, sent, bitmask=None) -> dict:
        return sent

    def _record(self, b, batch, seed) -> None:
        count, start, plen = int(batch.count[b]), int(batch.lengths[b]), int(batch.prompt_len[b])
        if count == 0 or start >= plen:  # an empty row, or a decode row
            return
        if hasattr(batch, "row"):  # a ragged step: row b is slot b, its tokens among the flat ones
            slot, fed = b, batch.tokens[(batch.row == b) & batch.valid]
        else:
            slot, fed = int(batch.slot[b]), batch.tokens[b, :count]
        if start == 0:
            self._prompts[slot] = []
        self._prompts[slot] += [int(t) for t in fed]
        if start + count >= plen and self.record is not None:
            with open(self.record, "a") as f:
                f.write(json.dumps({"seed": seed, "prompt": self._prompts.pop(slot)[:plen]}) + "\n")


def main(argv=None) -> int:
    own = argparse.ArgumentParser()
    own.add_argument("--scripts", required=True)
    own.add_argument("--record")
    own.add_argument("--fail-seed", type=int)
    mine, rest = own.parse_known_args(argv)

    from k2jax.runtime import engine as engine_module
    from k2jax.serving import server

    serve = argparse.ArgumentParser()
    server.add_arguments(serve)
    args = serve.parse_args(rest)

    def load_model(args):
        import jax.numpy as jnp

        import k2jax
        from k2jax.tokenizer import KimiTokenizer
        from tests.serve_util import CFG

        tok = KimiTokenizer.from_dir(args.tokenizer)
        cfg = k2jax.K2Config.from_hf_config(CFG)
        ScriptedRunner.scripts = {int(k) % 2**32: tok.encode(v, allow_special=True)
                                  for k, v in json.loads(Path(mine.scripts).read_text()).items()}
        ScriptedRunner.end_id = tok.special_tokens["<|im_end|>"]
        ScriptedRunner.record = Path(mine.record) if mine.record else None
        ScriptedRunner.fail_seed = mine.fail_seed
        params = {"embed_tokens": np.zeros((1, 1), np.float32)}  # the engine reads its dtype only
        return k2jax.K2Model(cfg, jnp.float32), params, tok, args.model_name or "scripted", None

    server.load_model = load_model
    engine_module.Runner = ScriptedRunner
    return server.run(args)


if __name__ == "__main__":
    sys.exit(main())
