"""Sharding rules autopar adds to DTensor's: ops DTensor has no rule for or shards in a way the
compiler cannot use (`op_rules.py`, the registry), attention (`attention_rules.py`), mixture-of-experts ops
(`expert_rules.py`), FP8 linear products (`float8_rules.py`) and random ops (`random_rules.py`: one device's values, or refused), all in one
registry (`registry.py`)."""

# importing the package registers every rule (each module's `@register`s)
from autopar.compiler.rules import attention_rules, expert_rules, float8_rules, op_rules, random_rules  # noqa: F401
from autopar.compiler.rules.random_rules import draws, one_device_draws, refuse_draw
from autopar.compiler.rules.registry import RuleContext, lookup
