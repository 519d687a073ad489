"""lm-evaluation-harness scores a live Crescent cluster through ``/v1/completions``.

A real cluster (router, conductor, a prefill and a decode worker, smollm2-135m, float32)
is started; lm-eval (``pip install "lm-eval[api]"`` in ``.venv-bench``: its pins are not
Crescent's) runs its ``local-completions`` model against it on a tiny local
multiple-choice task (a YAML task over a JSONL file this script writes: no dataset is
downloaded). lm-eval sends what it always sends for loglikelihoods: batches of token-id
prompts with ``echo: true``, ``logprobs: 1``, ``max_tokens: 1``, and reads the prompt's
own token logprobs back. The model's tokenizer is handed to lm-eval as a local HF
tokenizer directory (the GGUF's, exported as benchmarks/live_replay.py does), since
Crescent serves ``/tokenize`` but not vLLM's ``/tokenizer_info``.

Each (question, choice) loglikelihood lm-eval logged is checked against a reference
computed here by the engine alone (log_softmax of one forward over the same tokens), and
lm-eval's accuracy against the reference's.

    python benchmarks/lm_eval_local.py [--base-port 18800] [--batch-size 4]

Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.live_replay import export_tokenizer  # noqa: E402
from launch.cluster import LocalCluster  # noqa: E402

LM_EVAL = REPO / ".venv-bench" / "bin" / "lm_eval"
MODEL = "smollm2-135m"
TASK = "crescent_tiny_mc"
ITEMS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus"], 1),
    ("Water freezes at a temperature of zero degrees", ["Celsius", "Kelvin", "hours"], 0),
    ("The opposite of hot is", ["cold", "tall", "blue"], 0),
    ("A week has seven", ["days", "cats", "rivers"], 0),
    ("The sun rises in the", ["east", "west", "kitchen"], 0),
    ("Two plus two equals", ["four", "seven", "ten"], 0),
    ("The colour of the clear daytime sky is", ["green", "blue", "black"], 1),
]
CONFIG = """model = "{model}"
http_port = {http}
base_port = {base}
prefill_workers = 1
decode_workers = 1
heartbeat_interval_s = 0.2
[store]
enabled = false
[slo]
ttft_s = 120.0
tbt_s = 30.0
"""
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(where: Path) -> None:
    data = where / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in ITEMS))
    (where / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))


def run_lm_eval(url: str, tokenizer: Path, tasks: Path, out: Path, batch: int) -> float:
    args = ",".join([f"model={MODEL}", f"base_url={url}/v1/completions",
                     "tokenizer_backend=huggingface", f"tokenizer={tokenizer}",
                     "tokenized_requests=True", "num_concurrent=1", "max_retries=1"])
    cmd = [str(LM_EVAL), "--model", "local-completions", "--model_args", args,
           "--tasks", TASK, "--include_path", str(tasks), "--batch_size", str(batch),
           "--output_path", str(out), "--log_samples"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lm_eval.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"lm_eval failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return time.perf_counter() - started


def reference(pairs: list[tuple[str, str]]) -> list[float]:
    """Each (context, continuation)'s loglikelihood by the engine alone: lm-eval's split
    (trailing spaces of the context move to the continuation; the whole is encoded and
    cut at the context's length), summed log_softmax of one float32 forward."""
    import torch

    from common.engine import Engine, EngineConfig
    from common.engine.config import PrefillChunk

    engine = Engine(EngineConfig(num_blocks=64))
    out = []
    for context, continuation in pairs:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = engine.tokenizer.encode(context + continuation)
        n = len(engine.tokenizer.encode(context))
        blocks = engine.pool.allocate(engine.blocks_needed(len(whole)))
        try:
            hidden, _ = engine.stage_step([PrefillChunk(whole, 0, len(whole), blocks)])
            lp = torch.log_softmax(engine.model.logits(hidden).float(), -1)
        finally:
            engine.pool.free(blocks)
        out.append(sum(lp[i - 1, whole[i]].item() for i in range(n, len(whole))))
    return out


def samples(out: Path) -> list[dict[str, Any]]:
    found = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))
    if not found:
        raise SystemExit(f"no lm-eval samples under {out}")
    return [json.loads(line) for line in found[-1].read_text().splitlines() if line]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-port", type=int, default=18800)
    p.add_argument("--batch-size", type=int, default=4, help="prompts per request")
    args = p.parse_args(argv)
    if not LM_EVAL.exists():
        raise SystemExit(f"{LM_EVAL} missing: .venv-bench/bin/pip install \"lm-eval[api]\"")
    with tempfile.TemporaryDirectory(prefix="crescent-lm-eval-") as tmp:
        root = Path(tmp)
        write_task(root)
        tok = export_tokenizer(MODEL, MODEL, root / "tokenizer")
        tok_dir = next((tok.hub_cache).rglob("tokenizer.json")).parent
        cfg = root / "cluster.toml"
        cfg.write_text(CONFIG.format(model=MODEL, http=args.base_port,
                                     base=args.base_port + 5))
        cluster = LocalCluster(str(cfg), root / "logs")
        cluster.start(timeout_s=300)
        try:
            wall = run_lm_eval(cluster.url, tok_dir, root, root / "out", args.batch_size)
        finally:
            cluster.stop()
        rows = samples(root / "out")
    rows.sort(key=lambda r: r["doc_id"])
    # per doc: its (context, continuation) pairs, and lm-eval's (loglikelihood, is_greedy)
    pairs = [(v["arg_0"], v["arg_1"]) for r in rows for v in r["arguments"].values()]
    served = [float(resp[0]) for r in rows for resp in r["filtered_resps"]]
    want = reference(pairs)
    err = max(abs(a - b) for a, b in zip(served, want))
    acc = sum(r["acc"] for r in rows) / len(rows)
    ref_acc, i = 0, 0
    for (_, choices, answer) in ITEMS:
        lls = want[i:i + len(choices)]
        ref_acc += int(max(range(len(choices)), key=lambda k: lls[k]) == answer)
        i += len(choices)
    ref_acc /= len(ITEMS)
    print(f"{'items':>6} {'requests':>9} {'acc (lm-eval)':>14} {'acc (engine)':>13} "
          f"{'max |Δ loglik|':>15} {'wall s':>7}")
    print(f"{len(rows):>6} {len(pairs):>9} {acc:>14.3f} {ref_acc:>13.3f} {err:>15.2e} "
          f"{wall:>7.1f}")
    print(json.dumps({"benchmark": "lm_eval_local", "task": TASK, "items": len(rows),
                      "loglikelihoods": len(pairs), "batch_size": args.batch_size,
                      "acc": acc, "reference_acc": ref_acc, "max_abs_loglik_err": err,
                      "lm_eval_wall_s": round(wall, 2)}))
    return 0 if err < 1e-3 and acc == ref_acc else 1


if __name__ == "__main__":
    sys.exit(main())
