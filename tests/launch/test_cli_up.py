"""`crescent up` starts every role, says where the API is, restarts a child that dies, and
Ctrl-C stops them all."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]

CONFIG = """
http_port = 24200
base_port = 24210
decode_blocks = 256
prefill_blocks = 256
cost_profile = "cpu-smollm2-135m"  # no calibration (tests/e2e/conftest.py)

[store]
enabled = false
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_up_serves_then_ctrl_c_stops_every_child(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "up", "--config", str(cfg),
         "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "ready" in line or not line:
                break
        assert "OpenAI API at http://127.0.0.1:24200/v1" in "".join(lines), lines
        r = httpx.get("http://127.0.0.1:24200/v1/models", timeout=10)
        assert r.json()["data"][0]["id"] == "smollm2-135m"
        logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
        assert logs == ["conductor-0.log", "decode-0.log", "prefill-0.log", "router-0.log"]
        pids = subprocess.run(["pgrep", "-f", f"services.* --config {cfg}"],
                              capture_output=True, text=True).stdout.split()
        kids = [int(p) for p in pids]
        assert len(kids) == 4
        conductor = int(subprocess.run(["pgrep", "-f", f"services.conductor .*--config {cfg}"],
                                       capture_output=True, text=True).stdout.split()[0])
        os.kill(conductor, signal.SIGKILL)
        said = [proc.stdout.readline() for _ in range(2)]
        assert said == ["crescent: conductor-0 exited with code -9; restart 1 in 0.5 s\n",
                        said[1]] and said[1].startswith("crescent: restart 1 of conductor-0")
        kids = [int(p) for p in subprocess.run(["pgrep", "-f", f"services.* --config {cfg}"],
                                               capture_output=True, text=True).stdout.split()]
        assert len(kids) == 4 and conductor not in kids
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        time.sleep(0.5)
        assert [k for k in kids if alive(k)] == []
    finally:
        stop_up(proc)


def test_up_refuses_a_config_that_puts_processes_on_other_hosts(tmp_path: Path) -> None:
    """'up' starts everything here: a [hosts] address this machine does not have is named
    at once (exit 2), before any process starts, instead of failing to bind later."""
    from common.config import ClusterConfig
    from launch.cli import remote_processes

    assert remote_processes(ClusterConfig.from_dict({"http_port": 24200})) == []
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG + '\n[hosts]\ndecode = ["192.0.2.7"]\n')  # TEST-NET-1: not here
    done = subprocess.run([sys.executable, "-m", "launch.cli", "up", "--config", str(cfg),
                           "--log-dir", str(tmp_path / "logs")], cwd=REPO, timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "decode 0 at 192.0.2.7" in done.stderr and "crescent serve" in done.stderr
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


# the directories' configs beyond tests/model/tiny_checkpoints.py's SMALL
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "norm_topk_prob": True}


@pytest.mark.parametrize("kind", ["qwen3_moe-dir", "deepseek_v3-dir", "gemma3-gguf"])
def test_up_serves_a_checkpoint_to_the_official_client(tmp_path: Path, kind: str) -> None:
    """``crescent up --set model=...`` over a (tiny, random) Qwen3-MoE checkpoint
    directory (8 experts, 2 a token), a DeepSeek V3 one (latent attention: one KV head
    through the pool and the handover), or
    a Gemma 3 GGUF written as llama.cpp writes one (tests/model/gguf_files.py): the
    official client gets the in-process engine's greedy answer, streamed or not, the
    prompt as the checkpoint's own chat template renders it, and a forced tool call."""
    import json as jsonlib

    import openai
    from transformers import AutoTokenizer

    from common.engine import Engine, EngineConfig, SamplingParams, generate
    from tests.model.gguf_files import write_family
    from tests.model.tiny_checkpoints import write_chat_tokenizer, write_checkpoint

    arch, form = kind.split("-")
    name, directory = f"{arch}-tiny", tmp_path / f"{arch}-tiny"
    if form == "dir":
        from tests.model.test_architectures import FAMILIES

        write_checkpoint(arch, directory, max_position_embeddings=1024,  # the tools' prompt
                         **(MOE if arch == "qwen3_moe" else FAMILIES[arch]))
        write_chat_tokenizer(directory, "qwen")
        model = directory
    else:
        model = write_family(arch, directory, max_position_embeddings=1024)[2]
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.replace("24200", "24600").replace("24210", "24610"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "up", "--config", str(cfg), "--set",
         f"model={model}", "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            lines.append(proc.stdout.readline())
            if "ready" in lines[-1] or not lines[-1]:
                break
        assert "OpenAI API at http://127.0.0.1:24600/v1" in "".join(lines), lines
        client = openai.OpenAI(base_url="http://127.0.0.1:24600/v1", api_key="-", timeout=60)
        assert [m.id for m in client.models.list().data] == [name]
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is the weather in Paris today?"}]
        want_prompt = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        tokens = httpx.post("http://127.0.0.1:24600/tokenize", timeout=30, json={
            "model": name, "messages": messages}).json()["tokens"]
        assert tokens == list(want_prompt)
        engine = Engine(EngineConfig(model=str(model), num_blocks=64))
        want = generate(engine, tokens, SamplingParams(max_tokens=12, temperature=0.0))
        answer = client.chat.completions.create(model=name, messages=messages,
                                                max_tokens=12, temperature=0)
        assert answer.choices[0].message.content == want.text
        assert answer.usage.completion_tokens == len(want.token_ids)
        stream = client.chat.completions.create(model=name, messages=messages,
                                                max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) \
            == want.text
        tool = {"type": "function", "function": {
            "name": "get_weather", "parameters": {
                "type": "object", "required": ["city"],
                "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
        called = client.chat.completions.create(
            model=name, messages=messages, tools=[tool], max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        call = called.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert jsonlib.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        stop_up(proc)


def stop_up(proc: subprocess.Popen) -> None:
    """Stop ``crescent up`` and its children, also after a failure (killing only the
    launcher would leave them serving)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # it stops its children, then itself
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    if proc.poll() is None:
        proc.kill()
