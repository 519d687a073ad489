"""Quantized linears on the CPU (common/model/quant.py, csrc/linear_q.c, csrc/linear_int8.c),
side by side with the float ones, on the default model (SmolLM2-135M, whose GGUF is Q4_1,
its tied embeddings Q8_0):

- ``quantized``: ``quantization = "auto"``, the file's codes on the quantized kernel,
  float32 inputs;
- ``int8``: the same codes, ``linear_dtype = "int8"``: inputs rounded to int8 per group,
  integer dot products (llama.cpp's way);
- ``f32``: ``"none"``, the weights expanded to float32 on Crescent's float32 kernel (what
  every CPU worker ran before 2026-11-29: the same results as ``quantized``, bit for bit);
- ``bf16``: ``"none"`` with ``linear_dtype = "bfloat16"`` (``auto`` on a CPU with AVX-512
  BF16): the expansion rounded to bfloat16 on the bfloat16 kernel.

For each: decode steps (context ``--contexts``, batches ``--batches``; the least ms per
step of ``--rounds`` rounds, the variants in turn), a prompt's prefill (the least of the
rounds), the bytes of the weights each engine holds, and how far its next-token
distributions are from float32's (``f32``) over 512 positions of README.md fed one step at
a time (8 sequences of 64): the mean KL divergence and how often the top token agrees.
Then a LLaMA-3-8B-shaped model (``dummy-llama3-8b``, ``--big-layers`` of its layers and its
LM head, random weights) quantized at load (``q8_0``, ``q4_0``) against float32 and
bfloat16 (steps, prefill and bytes only). One thread by default (a decode worker's on 2
cores).

    python benchmarks/quantized.py [--batches 1,4,8,16,32] [--threads 1] [--big-layers 2]

Prints the tables, then one JSON line (``--out`` writes it to a file too).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.decode_step import compare  # noqa: E402
from common.engine import Engine, EngineConfig  # noqa: E402
from common.model import cpu_linear  # noqa: E402

SMALL = {"quantized": dict(quantization="auto"),
         "int8": dict(quantization="auto", linear_dtype="int8"),
         "f32": dict(quantization="none"),
         "bf16": dict(quantization="none", linear_dtype="bfloat16")}
BIG_MODEL = "dummy-llama3-8b"
BIG = {"q4_0": dict(quantization="q4_0"), "q4_0/int8": dict(quantization="q4_0",
                                                            linear_dtype="int8"),
       "q8_0/int8": dict(quantization="q8_0", linear_dtype="int8"),
       "f32": dict(quantization="none"), "bf16": dict(linear_dtype="bfloat16")}
REFERENCE = "f32"  # the distributions the others are compared with


def weight_bytes(engine: Engine) -> int:
    """Bytes of the weights the engine's linears (as packed) and embeddings hold."""
    model, total = engine.model, 0
    for _, linear in model.linears():
        native = linear.native
        parts = ([native.codes, native.params] if isinstance(native, cpu_linear.QuantLinear)
                 else [native.packed] if native is not None
                 else [t for t in (linear.packed, linear.weight) if t is not None])
        total += sum(t.nbytes for t in parts if isinstance(t, torch.Tensor))
    embed = model.embed  # the lookup's own, unless a tied LM head's codes serve it
    if embed is not None and not isinstance(embed, cpu_linear.QuantLinear):
        total += (embed.nbytes if isinstance(embed, torch.Tensor)
                  else embed.codes.nbytes + embed.scale.nbytes + embed.offset.nbytes)
    return total


def prefill_s(engine: Engine, tokens: int, rounds: int, adapter: Optional[str] = None
              ) -> float:
    prompt = [(7 * i + 11) % (engine.model_config.vocab_size - 10) + 5 for i in range(tokens)]
    table = engine.pool.allocate(engine.blocks_needed(tokens))
    best = float("inf")
    try:
        for _ in range(rounds):
            started = time.perf_counter()
            engine.prefill(prompt, table, adapter=adapter)
            best = min(best, time.perf_counter() - started)
    finally:
        engine.pool.free(table)
    return best


def next_token_logprobs(engine: Engine, text: str, sequences: int = 8,
                        length: int = 64) -> torch.Tensor:
    """[sequences * length, vocab] log-probabilities of each next token of ``text``'s
    first ``sequences * length`` tokens, cut into ``sequences`` fed one step at a time
    together (the decode path)."""
    from common.engine.config import DecodeInput

    ids = engine.encode(text)[:sequences * length]
    cuts = [ids[i * length:(i + 1) * length] for i in range(sequences)]
    tables = [engine.pool.allocate(engine.blocks_needed(length)) for _ in cuts]
    rows = []
    try:
        for p in range(length):
            step = [DecodeInput(cut[p], p, table) for cut, table in zip(cuts, tables)]
            rows.append(torch.log_softmax(engine.decode_step(step).float(), -1))
    finally:
        for table in tables:
            engine.pool.free(table)
    return torch.stack(rows, 1).flatten(0, 1)


def fidelity(engines: dict[str, Engine]) -> dict[str, dict[str, float]]:
    """Each engine's mean KL(``REFERENCE`` || it) and top-1 agreement over README.md."""
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "README.md")) as f:
        text = f.read()
    logprobs = {name: next_token_logprobs(e, text) for name, e in engines.items()}
    ref = logprobs[REFERENCE]
    return {name: {"kl": float((ref.exp() * (ref - lp)).sum(-1).mean()),
                   "top1_agree": float((ref.argmax(-1) == lp.argmax(-1)).float().mean())}
            for name, lp in logprobs.items() if name != REFERENCE}


def run(model: str, variants: dict[str, dict], args: argparse.Namespace,
        layers: int | None = None, compare_tokens: bool = True) -> dict:
    def make(name: str, blocks: int) -> Engine:
        return Engine(EngineConfig(model=model, num_layers=layers, kv_dtype="bfloat16",
                                   num_blocks=blocks, **variants[name]))

    engines: dict[str, Engine] = {}

    def made(name: str, blocks: int) -> Engine:
        engines[name] = make(name, blocks)
        return engines[name]

    print(f"\n{model}" + (f", {layers} layers" if layers else "") + ": ms per decode step")
    steps = compare(args, made, variants)
    prefill = {name: round(prefill_s(e, args.prompt, args.rounds), 3)
               for name, e in engines.items()}
    sizes = {name: round(weight_bytes(e) / 2**20, 1) for name, e in engines.items()}
    print(f"{'':>14}" + "".join(f"{n:>20}" for n in engines))
    print(f"{f'prefill {args.prompt} s':>14}" + "".join(f"{prefill[n]:>20.3f}" for n in engines))
    print(f"{'weights MiB':>14}" + "".join(f"{sizes[n]:>20.1f}" for n in engines))
    result = {"steps_ms": steps, f"prefill_{args.prompt}_s": prefill, "weights_mib": sizes}
    if compare_tokens:
        near = result[f"kl_top1_vs_{REFERENCE}"] = fidelity(engines)
        print(f"{f'KL vs {REFERENCE}':>14}" + "".join(
            f"{near[n]['kl'] if n in near else 0:>20.2e}" for n in engines))
        print(f"{'top-1 agrees':>14}" + "".join(
            f"{near[n]['top1_agree'] if n in near else 1:>20.3f}" for n in engines))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="600")
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512, help="tokens of the timed prefill")
    ap.add_argument("--threads", type=int, default=1, help="torch's (the kernels split on them)")
    ap.add_argument("--big-layers", type=int, default=2,
                    help=f"layers of {BIG_MODEL} (0: skip it)")
    ap.add_argument("--out", help="also write the JSON line here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_linear.quant_kernel() is None:
        sys.exit("the quantized kernel does not run on this CPU (no compiler or no AVX-512)")
    result = {"threads": args.threads, "smollm2-135m": run("smollm2-135m", SMALL, args)}
    if args.big_layers:
        big_args = argparse.Namespace(**{**vars(args), "batches": "1,8"})
        result[BIG_MODEL] = run(BIG_MODEL, BIG, big_args, args.big_layers,
                                compare_tokens=False)  # random weights: no text to read
    emit(result, args.out)


def emit(result: dict, out: str | None) -> None:
    """The benchmark's last line: ``result`` as JSON, written to ``out`` too if given."""
    line = json.dumps(result)
    print(line)
    if out:
        with open(out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
