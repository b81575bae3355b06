"""What each of the chunked head's strategies (``covey.train.head``) gains against the simpler way it
replaces: the head's log-prob pass alone, forward and backward, on random hidden states of SmolLM2-135M's
shape (hidden 576, vocabulary 49,152, float32, temperature 1, the entropy logged but not trained).

    python -m benchmarks.head_strategies --repeats 5 [--tokens 682] [--frozen-tokens 2048] [--memory]

Each pair runs in one process, the two ways alternating; the median wall and CPU seconds of ``--repeats``
runs, and the ratio of the simpler way to the strategy (above 1: the strategy is faster). ``--memory``: the
most bytes of tensors made by the pass alive at once, one more run of each way. The simpler ways are the
strategy switched off in this process only:

- kept chunks: the default budget against a budget of 0 (every chunk's logits computed again);
- the plain softmax made by the head: against the way through ``core.token_logprobs`` that a transform or
  a truncation takes (``_Pass.plain`` off);
- a computed-again chunk's log-softmax from the forward's log-probs: against a log-softmax made again;
- a frozen head's slopes: against the trained head's way with only the hidden states' gradient.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch

VOCAB, HIDDEN = 49152, 576


def head_model(softcap: float | None = None):
    """A one-layer Llama of SmolLM2-135M's hidden size and vocabulary, untied, random weights; ``softcap``:
    Gemma's final-logit softcapping after its head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=False)
    config.final_logit_softcapping = softcap
    return LlamaForCausalLM(config)


@contextmanager
def not_plain():
    from covey.train import head

    with mock.patch.object(head._Pass, "plain", property(lambda self: False)):
        yield


@contextmanager
def log_softmax_again():
    from covey.train import head

    with mock.patch.object(head, "_log_p_again", lambda linear, ids, t, logp, into: (linear.float() / t).log_softmax(-1)):
        yield


@contextmanager
def frozen_as_trained():
    from covey.train import head

    apply = head._ChunkedLinearHead.apply
    with mock.patch.object(head._ChunkedLinearHead, "apply",
                           lambda hidden, weight, bias, ids, run: apply(hidden, weight, bias, ids,
                                                                        dataclasses.replace(run, frozen=False))):
        yield


def run_pass(model, hidden, ids, budget: int | None, switch) -> None:
    from covey.core import logprob_chunk_tokens
    from covey.train.head import head_logprobs

    model.zero_grad(set_to_none=True)
    hidden.grad = None
    with ExitStack() as stack:
        if switch is not None:
            stack.enter_context(switch())
        logp, _ = head_logprobs(model, hidden, ids, 1.0, with_entropy=True, chunk=logprob_chunk_tokens(VOCAB),
                                 budget=budget)
        logp.sum().backward()


def compare(name: str, model, tokens: int, strategy: tuple, simpler: tuple, repeats: int, memory: bool) -> None:
    """``strategy`` and ``simpler``: (budget, switch) each, timed alternately."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=g, requires_grad=True)
    ids = torch.randint(0, VOCAB, (tokens,), generator=g)
    ways = {"strategy": strategy, "simpler": simpler}
    wall = {w: [] for w in ways}
    cpu = {w: [] for w in ways}
    run_pass(model, hidden, ids, *strategy)  # warm-up
    for _ in range(repeats):
        for way, (budget, switch) in ways.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            run_pass(model, hidden, ids, budget, switch)
            wall[way].append(time.perf_counter() - start)
            cpu[way].append(time.process_time() - start_cpu)
    med = {w: (statistics.median(wall[w]), statistics.median(cpu[w])) for w in ways}
    cells = [f"{med[w][0]:.2f} / {med[w][1]:.2f}" for w in ways]
    ratio = f"{med['simpler'][0] / med['strategy'][0]:.2f} / {med['simpler'][1] / med['strategy'][1]:.2f}"
    peaks = ""
    if memory:
        from benchmarks.logprob_memory import LiveTensors

        mib = []
        for budget, switch in ways.values():
            with LiveTensors() as live:
                run_pass(model, hidden, ids, budget, switch)
            mib.append(f"{live.most / 2**20:.0f}")
        peaks = " | " + " / ".join(mib)
    print(f"| {name} | {tokens:,} | {cells[0]} | {cells[1]} | {ratio}{peaks} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=682, help="the default budget's chunk at this vocabulary")
    parser.add_argument("--frozen-tokens", type=int, default=2048, help="a frozen head's tokens: three chunks")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--only", nargs="*", help="the rows to run (their first word)")
    args = parser.parse_args()
    from benchmarks.common import machine

    print(f"machine: {machine()}")
    print("| strategy | tokens | strategy s (wall / CPU) | simpler s (wall / CPU) | simpler / strategy"
          + (" | tensors MiB (strategy / simpler)" if args.memory else "") + " |")
    print("|---|---|---|---|---|" + ("---|" if args.memory else ""))
    trained, softcapped = head_model(), head_model(softcap=30.0)
    rows = {
        "kept": ("kept chunks (plain head) vs computed again", trained, args.tokens, (None, None), (0, None)),
        "kept-softcap": ("kept chunks (softcapped head) vs computed again", softcapped, args.tokens, (None, None),
                         (0, None)),
        "plain": ("the head's own softmax vs through core.token_logprobs", trained, args.tokens, (None, None),
                  (None, not_plain)),
        "again": ("log-softmax from the forward's log-probs vs made again", trained, args.tokens, (0, None),
                  (0, log_softmax_again)),
    }
    for key, (name, model, tokens, strategy, simpler) in rows.items():
        if not args.only or key in args.only:
            compare(name, model, tokens, strategy, simpler, args.repeats, args.memory)
    if not args.only or "frozen" in args.only or "frozen-plain" in args.only:
        trained.lm_head.weight.requires_grad_(False)
        if not args.only or "frozen" in args.only:
            compare("a frozen head's slopes vs the trained head's way", trained, args.frozen_tokens, (None, None),
                    (None, frozen_as_trained), args.repeats, args.memory)
        if not args.only or "frozen-plain" in args.only:
            compare("a frozen head's slopes: the head's own softmax vs through core.token_logprobs", trained,
                    args.frozen_tokens, (None, None), (None, not_plain), args.repeats, args.memory)


if __name__ == "__main__":
    main()
