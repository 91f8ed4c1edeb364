"""A user's mistakes at run time, caught where they are made, on every rank that can see them.

- An optimizer built over the model's parameters before `parallelize` (the returned module holds
  new ones): `OptimizerParametersError` at its first step, naming the parameter and the fix
  (`autopar/runtime/optimizer_guard.py`), on every rank; an optimizer over the module's parameters
  steps as usual.
- A token id outside the embedding's vocabulary, or a target outside the loss's classes: an
  `InputValueError` naming the input, the value, where it sits and the table
  (`autopar/runtime/input_values.py`) — on every rank when the global batch goes through
  `local_batch`; on the rank holding it when a rank's own share goes to `forward`. Never an
  `IndexError` on one rank and a closed connection on the others.
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.runtime.launch import launch
from examples.gpt import example


def _errors(rank: int, world: int) -> dict[str, str]:
    """Each mistake in turn on this rank: the error's type and text (or 'ok')."""
    torch.manual_seed(0)
    model, batch = example(batch=4)
    early = torch.optim.AdamW(model.parameters(), lr=1e-3)  # before parallelize: the mistake
    module = autopar.parallelize(model, "dp=2", strategies=[autopar.data_parallel()], example_inputs=batch)
    found = {}

    def attempt(name: str, action) -> None:
        try:
            action()
            found[name] = "ok"
        except Exception as error:  # the test asserts which type each case raises
            found[name] = f"{type(error).__name__}: {error}"

    def train(optimizer: torch.optim.Optimizer) -> None:
        module(*module.local_batch(*batch)).backward()
        optimizer.step()
        optimizer.zero_grad()

    attempt("early optimizer", lambda: train(early))
    attempt("module's optimizer", lambda: train(torch.optim.AdamW(module.parameters(), lr=1e-3)))
    idx, targets = batch
    bad_token = idx.clone()
    bad_token[3, 5] = 130  # vocabulary 128; row 3 is rank 1's under dp=2 over 4 rows
    attempt("global bad token", lambda: module(*module.local_batch(bad_token, targets)))
    bad_target = targets.clone()
    bad_target[0, 1] = -7
    attempt("global bad target", lambda: module(*module.local_batch(idx, bad_target)))
    ignored = targets.clone()
    ignored[0, 1] = -100  # the loss's ignore_index is a valid target
    attempt("ignored target", lambda: module(*module.local_batch(idx, ignored)))
    if rank == 1:  # its share holds the bad id; rank 0's forward would wait in the loss's all-reduce
        local = module.plan.local_inputs([bad_token, targets], rank)  # the share, sliced without the check
        attempt("local bad token", lambda: module(*local))
    return found


@pytest.fixture(scope="module")
def errors() -> list[dict[str, str]]:
    return launch(_errors, 2, timeout_s=60)


def test_an_optimizer_over_the_replaced_parameters_is_refused_at_its_first_step(errors):
    for rank in errors:
        text = rank["early optimizer"]
        assert text.startswith("OptimizerParametersError"), text
        assert "embed_tokens.weight" in text and "fix: build the optimizer after parallelize" in text, text
        assert rank["module's optimizer"] == "ok"


def test_an_id_outside_the_vocabulary_in_the_global_batch_is_refused_on_every_rank(errors):
    for rank in errors:
        text = rank["global bad token"]
        assert text.startswith("InputValueError: input 0 ('idx') holds 130 at index (3, 5)"), text
        assert "the embedding in 'embed_tokens' (128 rows)" in text and "examples/gpt.py" in text, text
        assert rank["global bad target"].startswith("InputValueError: input 1 ('targets') holds -7"), rank
        assert rank["ignored target"] == "ok"


def test_an_id_outside_the_vocabulary_in_a_ranks_share_is_refused_where_it_is(errors):
    text = errors[1]["local bad token"]
    assert text.startswith("InputValueError: input 0 ('idx') holds 130 at index (1, 5) (this rank's share"), text
