"""Every registered layer rule, through its own examples, against a per-example loop.

A rule is tested here by being registered: its ``examples()`` give small modules of
each type it is registered for, and each runs through DPEngine (strict mode: the rule,
not the torch.func fallback) with every norm method and two groupings.
"""

import pytest

from dpclip.engine.layers import registered_rules
from tests.engine.conftest import check_example_exact

RULES = registered_rules()
EXAMPLES = [pytest.param(example, id=f"{rule.name}-{type(example.module).__name__}-{j}")
            for rule in {id(r): r for r in RULES.values()}.values()
            for j, example in enumerate(rule.examples())]


@pytest.mark.parametrize("example", EXAMPLES)
@pytest.mark.parametrize("method", ["auto", "ghost", "instantiate"])
def test_rule_norms_and_clipped_sums_match_per_example_loop(example, method):
    check_example_exact(example, "all-layer", norm_method=method)


@pytest.mark.parametrize("example", EXAMPLES)
def test_rule_is_exact_with_one_group_per_parameter(example):
    check_example_exact(example, "param")


@pytest.mark.parametrize("module_type", list(RULES), ids=lambda t: t.__name__)
def test_every_registered_type_has_an_example_of_its_own(module_type):
    examples = RULES[module_type].examples()
    assert any(type(e.module) is module_type for e in examples), (
        f"{module_type.__name__}'s rule has no example module of that type")
