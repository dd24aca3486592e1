"""The embedded default's small-budget recipe and its experiments: the fictional worlds
(make_toy.py), the oracle that acts their reasoning chains out for either agent (oracle.py), the
recipe steps train.py calls, each a no-op in the paper preset (recipe.py); MemSearcher against
ReAct trained alike (compare_agents.py); GRPO from three worlds' warm starts and the validation
curve (rl_worlds.py); and the probes of docs/learning.md (choice_probe.py, chain_funnel.py,
plot_heldout.py)."""
