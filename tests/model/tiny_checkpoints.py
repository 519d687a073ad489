"""Tiny random HF checkpoints that transformers builds and saves, as a user's directory
would be: config.json and model.safetensors, and, for serving, a small byte-level BPE
tokenizer trained here with a chat template of the family's kind.

The two templates are written for these tests in the families' conventions (ChatML turns
with the tools in the system turn and ``<tool_call>`` answers as Qwen's; Gemma's
``<start_of_turn>`` turns, the assistant called ``model``, system text folded into the
first user turn); they are not the checkpoints' own files.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, initializer_range=0.2)

CHATML_TOOLS = (
    "{%- set first_system = messages and messages[0].role == 'system' %}"
    "{%- if tools %}<|im_start|>system\n"
    "{% if first_system %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nThese functions can be called, one JSON signature each in <tools></tools>:\n"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "To call one, answer with a JSON object of its name and arguments in "
    "<tool_call></tool_call>:\n<tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n"
    "</tool_call><|im_end|>\n"
    "{% elif first_system %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}{% continue %}{% endif %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

GEMMA_TURNS = (
    "{{ bos_token }}"
    "{%- set system = messages[0].content + '\n\n' if messages[0].role == 'system' else '' %}"
    "{%- for m in messages if m.role != 'system' %}"
    "{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('turns must alternate user/assistant') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ (system if loop.first else '') + m.content | trim }}<end_of_turn>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# the template, the special tokens, and which ends a turn, per family
CHAT = {
    "qwen": (CHATML_TOOLS, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>",
             None),
    "gemma": (GEMMA_TURNS, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
              "<end_of_turn>", "<bos>"),
}
_TEXT = ("The quick brown fox jumps over the lazy dog. What is the weather in Paris today? "
         "Tools, functions and arguments: {\"city\": \"Paris\", \"unit\": \"celsius\"}. "
         "Count from one to ten: 1 2 3 4 5 6 7 8 9 10. Hello, world! ") * 20


def write_checkpoint(model_type: str, path: Path, **config: Any) -> torch.nn.Module:
    """A random checkpoint of ``model_type`` saved by transformers (every parameter,
    norms and biases too, perturbed so that none is a neutral 0 or 1); the model back."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(model_type, **{**SMALL, **config})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return model


def write_chat_tokenizer(path: Path, chat: str) -> dict[str, int]:
    """tokenizer.json (a byte-level BPE of SMALL's vocabulary, trained here) and
    tokenizer_config.json with ``CHAT[chat]``'s template into ``path``; config.json's
    end of sequence becomes the turn end. Returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    template, specials, turn_end, bos = CHAT[chat]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SMALL["vocab_size"], special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in specials}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "eos_token": turn_end, "bos_token": bos,
        "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}))
    config = json.loads((path / "config.json").read_text())
    config.update(eos_token_id=ids[turn_end], bos_token_id=ids.get(bos), pad_token_id=None)
    (path / "config.json").write_text(json.dumps(config))
    return ids


def reference_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of ``ids``."""
    return hf(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def assert_decodes_as(engine: Any, hf: torch.nn.Module, prompts: list[list[int]],
                      steps: int) -> None:
    """``engine`` prefills each prompt, then decodes them together greedily for ``steps``
    steps, every logit within 1e-4 of transformers' ``hf`` on the same sequence."""
    from common.engine.config import DecodeInput

    tables = [engine.pool.allocate(engine.blocks_needed(len(p) + steps)) for p in prompts]
    seqs = [list(p) for p in prompts]
    logits = [engine.prefill(p, t) for p, t in zip(prompts, tables)]
    for _ in range(steps + 1):
        for row, seq in zip(logits, seqs):
            assert (row - reference_logits(hf, seq)[-1]).abs().max().item() < 1e-4
        if len(seqs[0]) == len(prompts[0]) + steps:
            break
        for row, seq in zip(logits, seqs):
            seq.append(int(row.argmax()))
        logits = engine.decode_step([DecodeInput(s[-1], len(s) - 1, t)
                                     for s, t in zip(seqs, tables)])
    for t in tables:
        engine.pool.free(t)


def greedy_rows(engine: Any, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """A prefill of each prompt, then greedy decode steps of them together: every row."""
    from common.engine.config import DecodeInput

    tables = [engine.pool.allocate(engine.blocks_needed(len(p) + steps)) for p in prompts]
    seqs = [list(p) for p in prompts]
    rows = [engine.prefill(p, t) for p, t in zip(prompts, tables)]
    out = list(rows)
    for _ in range(steps):
        for row, seq in zip(rows, seqs):
            seq.append(int(row.argmax()))
        rows = list(engine.decode_step([DecodeInput(s[-1], len(s) - 1, t)
                                        for s, t in zip(seqs, tables)]))
        out += rows
    for t in tables:
        engine.pool.free(t)
    return out


def assert_alone_as_in_a_batch(engine: Any, prompts: list[list[int]], steps: int
                               ) -> list[torch.Tensor]:
    """The first prompt's rows (``greedy_rows``) are the same bit for bit alone as decoded
    beside the others; all the rows, batched, back."""
    together = greedy_rows(engine, prompts, steps)
    alone = greedy_rows(engine, prompts[:1], steps)
    assert all(torch.equal(x, y) for x, y in zip(alone, together[0::len(prompts)]))
    return together
