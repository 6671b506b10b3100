"""`k2jax serve` over two CPU processes (jax.distributed on 127.0.0.1, 4 simulated devices each, slots split
over 'data' and experts over 'expert' across both): process 0 answers real HTTP requests with the tokens
one process gives, process 1 serves nothing itself and stops when process 0 does, also when SIGTERM comes
with a request in flight."""

import asyncio
import json
import random
import subprocess
import sys

import jax.numpy as jnp
import openai

import k2jax
from k2jax.checkpoint.convert import main as convert_main
from tests.serve_util import free_port, running, serve_argv, stream_in_background, write_model

PROMPTS = [[5, 6, 7], list(range(20, 51)), [42], [random.Random(k).randrange(2, 1000) for k in range(17)]]
NEW = [6, 3, 9, 5]


def test_two_process_server_answers_with_the_tokens_of_one_process(tmp_path):
    ckpt, tok = write_model(tmp_path)
    conv = tmp_path / "conv"
    assert convert_main([str(ckpt), str(conv), "--quiet"]) == 0
    cfg, params = k2jax.load(conv, dtype=jnp.float32)
    model = k2jax.K2Model(cfg, jnp.float32)
    want = [k2jax.generate(model, params, [p], n)[0][0].tolist() for p, n in zip(PROMPTS, NEW)]

    port, coord = free_port(), free_port()
    argvs = [serve_argv(ckpt, tok, port, "--max-batch", "4", "--max-len", "64", "--prefill-chunk", "16",
                        "--mesh", "data=2,expert=4", "--drain-timeout", "1", "--coordinator", f"127.0.0.1:{coord}",
                        "--num-processes", "2",
                        "--process-id", str(rank)) for rank in range(2)]
    for a in argvs:  # the converted checkpoint: --mesh shards it
        i = a.index("--hf-checkpoint")
        a[i:i + 2] = ["--checkpoint", str(conv)]
    with running(argvs, port, devices=4) as procs:
        async def main():
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none") as c:
                rs = await asyncio.gather(*(c.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0,
                                                                 extra_body={"ignore_eos": True})
                                            for p, n in zip(PROMPTS, NEW)))
                return [r.choices[0].token_ids for r in rs]

        got = asyncio.run(main())
        assert got == want
        assert asyncio.run(main()) == want  # and again, with the slots reused

        async def constrained():  # grammar rows beside free ones: each process makes its rows' masks
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none") as c:
                chats = [c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"hi {i}"}],
                                                   response_format={"type": "json_object"}, max_tokens=6,
                                                   temperature=0) for i in range(2)]
                free = [c.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0,
                                             extra_body={"ignore_eos": True}) for p, n in zip(PROMPTS[:2], NEW)]
                return await asyncio.gather(*chats, *free)

        rs = asyncio.run(constrained())
        for r in rs[:2]:
            assert r.choices[0].message.content.lstrip().startswith("{"), r.choices[0].message.content
        assert [r.choices[0].token_ids for r in rs[2:]] == want[:2]
        # A stream in flight at SIGTERM: it finishes within the drain or ends with "abort", then [DONE]; both
        # processes stop (process 1 also ignores a SIGTERM of its own).
        lines, reader = stream_in_background(port, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 60,
                                                    "temperature": 0, "ignore_eos": True, "stream": True})
        procs[1].terminate()
        procs[0].terminate()  # SIGTERM, as a supervisor stops a server
        reader.join(120)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "abort")
        try:
            rcs = [p.wait(timeout=60) for p in procs]  # process 0's stop reaches 1 through the key-value store
        except subprocess.TimeoutExpired:
            raise AssertionError("the processes did not stop after SIGTERM to process 0") from None
        out0, out1 = (p.stdout.read() for p in procs)
        assert rcs == [0, 0], f"exit codes {rcs}\n--- process 0:\n{out0[-2000:]}\n--- process 1:\n{out1[-2000:]}"
        assert "http://" not in out1, "only process 0 runs HTTP"
        assert "Traceback" not in out0 + out1, f"--- process 0:\n{out0[-2000:]}\n--- process 1:\n{out1[-2000:]}"


def test_serve_help_lists_the_flags():
    out = subprocess.run([sys.executable, "-m", "k2jax.cli", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--checkpoint", "--hf-checkpoint", "--demo", "--tokenizer", "--host", "--port", "--max-batch",
                 "--max-len", "--prefill-chunk", "--mesh", "--dtype", "--quant", "--kv-cache-dtype", "--distributed",
                 "--api-key", "--drain-timeout", "--stats-interval", "--no-access-log",
                 "--coordinator", "--num-processes", "--process-id"):
        assert flag in out, flag
