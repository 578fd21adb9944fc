"""generate() of a nanguard-patched Hugging Face model against the stock one.

A Llama-style model from a small config (4 layers, hidden 512, 8 query heads
over 8 or 2 kv heads, random weights; nothing is downloaded), greedy
decoding with the KV cache: batch 4, a prompt of 256 tokens (the first rows
left-padded, so every step carries a padding mask), 32 new tokens, fp32 and
bf16. The patched model is a deep copy of the stock one that shares its
weight tensors (one copy of each in memory: where a model's 65 MB LM head
lands in memory moved a deep copy's matmuls by up to 5% against the
original's, more than the code difference measured here). The two are timed
in the same process with their calls interleaved in alternating order; the ratio is the
median over repeats of each pair's stock time / patched time (> 1: the
patched model is faster), which a slow drift of the machine's speed during
the run affects less than a ratio of two medians. Both must produce the same tokens (fp32:
checked; bf16: reported, since rounding may flip a near tie).

    python bench/bench_generate.py [--repeats 15] [--threads N] [--kv-heads 8,2] [--dtypes float32,bfloat16]
                                   [--control]

--control adds the same measurement of an unpatched deep copy against the
stock model (column control_vs_stock): two identical models, so its
distance from 1 is the benchmark's own noise on this machine, the yardstick
for vs_stock.

Results: rows appended to bench/results/generate_<device>.jsonl, each naming
the CPU model, its ISA flags, nanguard's CPU path (NANGUARD_CPU_ISA=avx2 caps
it) and the threads; summarised in generate_<device>.md.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

import nanguard  # noqa: E402

LAYERS, HIDDEN, HEADS, VOCAB = 4, 512, 8, 32000
BATCH, PROMPT, NEW = 4, 256, 32


def build(kv_heads: int, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN // 3 * 2,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                      max_position_embeddings=PROMPT + NEW + 8, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def twin(model):
    """A deep copy of ``model`` whose parameters and buffers are ``model``'s
    own tensors (patching it swaps modules, never weights)."""
    new = copy.deepcopy(model)
    new.load_state_dict(model.state_dict(keep_vars=True), assign=True)
    return new


def prompt(device: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, PROMPT), generator=g)
    am = torch.ones(BATCH, PROMPT, dtype=torch.long)
    for b in range(BATCH // 2):  # left padding of 16 and 48 tokens
        n = 16 + 32 * b
        ids[b, :n] = 0
        am[b, :n] = 0
    return ids.to(device), am.to(device)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3 if _common.quick() else 15)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--kv-heads", default="8,2")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--control", action="store_true",
                   help="also time an unpatched copy against the stock model (the noise floor)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    ids, am = prompt(dev)
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, use_cache=True, pad_token_id=0)
    print(_common.describe() if dev == "cpu" else f"threads: {torch.get_num_threads()}, device: {dev}", flush=True)
    rows = []
    for dtype in (getattr(torch, x) for x in args.dtypes.split(",")):
        for kv in (int(x) for x in args.kv_heads.split(",")):
            stock = build(kv, dtype).to(dev)
            ours = twin(stock)
            nanguard.patch(ours)
            assert ours.lm_head.weight.data_ptr() == stock.lm_head.weight.data_ptr()
            outs = {}

            def mk(name, model):
                def run():
                    with torch.inference_mode():
                        outs[name] = model.generate(input_ids=ids, attention_mask=am, **kw)
                return run

            t, ratio = _common.paired_times(mk("nanguard", ours), mk("stock", stock), repeats=args.repeats,
                                            device=dev)
            same = bool(torch.equal(outs["nanguard"], outs["stock"]))
            if dtype == torch.float32 and not same:
                raise SystemExit("fp32: the patched model generated other tokens than the stock one")
            row = {"dtype": str(dtype).replace("torch.", ""), "heads": f"{HEADS}/{kv}",
                   "nanguard_s": t[0], "stock_s": t[1], "vs_stock": ratio,
                   "same_tokens": same}
            if args.control:
                control = twin(stock)  # made as `ours` is, left unpatched
                row["control_vs_stock"] = _common.paired_times(mk("twin", control), mk("stock", stock),
                                                               repeats=args.repeats, device=dev)[1]
            rows.append(row)
            print(row, flush=True)
    cols = ["dtype", "heads", "nanguard_s", "stock_s", "vs_stock", "same_tokens"]
    if args.control:
        cols.append("control_vs_stock")
    _common.write_results(f"generate_{dev}", "main", rows, cols,
                          {"layers": LAYERS, "hidden": HIDDEN, "batch": BATCH, "prompt": PROMPT, "new_tokens": NEW,
                           "repeats": args.repeats, "control": args.control})


if __name__ == "__main__":
    main()
