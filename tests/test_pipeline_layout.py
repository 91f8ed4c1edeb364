"""Uneven pipeline stages declared as a layout string (`autopar/compiler/strategies/pipeline_layout.py`).

- Parsing: repetition of a symbol and of a group, the embedding first and the head last, and the
  refusals (an unknown symbol, unbalanced parentheses, a stage without a block, both `stages=`
  and `layout=`, a layout whose block count is not the model's).
- Numerics: the example GPT with 6 blocks on pp=4 under 1F1B with the layout `Et|tt|tt|tL`
  (1, 2, 2, 1 blocks: the stages carrying the embedding and the head lighter), 3 AdamW steps on
  gloo ranks: loss, whole gradients and parameters equal one device on the same micro-batches
  (fp32 rel <= 1e-5); the ledger equals the messages counted from outside and the memory ledger
  the bytes held; each rank holds the blocks the layout gave its stage.
"""
from __future__ import annotations

import functools

import pytest

import autopar
from autopar.compiler.strategies.pipeline_layout import cut_points, parse_layout
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from tests.numerics import STEPS, distributed_rank, single_device
from tests.numerics_checks import assert_ledger_equals_measured, assert_matches, assert_memory_equals_ledger


@pytest.mark.parametrize("text, counts", [
    ("Et|tt|tt|tL", (1, 2, 2, 1)),
    ("Et|(tt|)*3t|tL", (1, 2, 2, 2, 1, 1)),
    ("t*3|t*5", (3, 5)),
    ("(tt|)*4", (2, 2, 2, 2)),
    (" E t | t t L ", (1, 2)),
])
def test_layouts_parse_into_blocks_per_stage(text, counts):
    assert parse_layout(text) == counts


def test_cut_points_are_the_block_indices_where_stages_start():
    assert cut_points((1, 2, 2, 1)) == ("1", "3", "5")


@pytest.mark.parametrize("text, message", [
    ("Etx|t", "cannot read 'x'"),
    ("E(t|", "'(' without its ')'"),
    ("Et)|t", "')' without its '('"),
    ("tE|t", "embedding (E) comes first"),
    ("Et|Lt", "head and loss (L) come last"),
    ("Et*2|tt|L", "stage 2 (L) holds no block"),
    ("E|tt|tL", "stage 0 (E) holds no block"),
])
def test_bad_layouts_are_refused_by_name(text, message):
    with pytest.raises(autopar.PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_layout(text)


CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=6, n_head=4, d_model=32, d_ff=64)
BUILD = functools.partial(GPT, CONFIG)
BATCHES = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]
LAYOUT = "Et|tt|tt|tL"


def test_a_layout_and_stages_together_or_a_wrong_block_count_are_refused():
    with pytest.raises(autopar.PlanError, match="stages= or layout=, not both"):
        autopar.pipeline_parallel(layout=LAYOUT, stages=["layers.2"])
    with pytest.raises(autopar.PlanError, match=r"lists 4 blocks \(t\) but the model has 6") as error:
        autopar.plan(BUILD(), "pp=4", strategies=[autopar.pipeline_parallel(layout="Et|t|t|tL")],
                     example_inputs=BATCHES[0])
    assert "fix: a layout with 6 t" in str(error.value)


def _pipelined(module, local):
    return module.train_step(*local)


def _blocks_held(module, rank: int) -> dict:
    names = {name.split(".")[1] for name, _ in module.named_parameters() if name.startswith("layers.")}
    return {"blocks": sorted(int(n) for n in names)}


def _layout_rank(rank: int, world: int) -> dict:
    strategies = [autopar.pipeline_parallel(layout=LAYOUT, schedule="1f1b", microbatches=4)]
    return distributed_rank(rank, world, BUILD, BATCHES, "pp=4", strategies, step=_pipelined, after=_blocks_held)


def test_an_uneven_layout_on_four_stages_equals_one_device():
    results = launch(_layout_rank, 4, timeout_s=240)
    reference = single_device(BUILD, BATCHES, microbatches=4)
    assert_matches(reference, results)
    assert_ledger_equals_measured(results)
    assert_memory_equals_ledger(results, reference, activations=False)
    assert [result["blocks"] for result in results] == [[0], [1, 2], [3, 4], [5]]
