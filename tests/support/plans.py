"""Cost-aware plans for tests: runs plan with a given cost table instead of this machine's, so each plan follows
from the table and the run's verdicts alone (and a test can ask for plans that change along a run)."""
from studio.engine.cost_model import CostTable

# at the prior acceptance (0.5) one draft pays, after one rejection (1/3) none does: plans switch along a run
ISD_MIXED = (1.0, 1.25, 1.35, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0)      # ISD: 1 draft is a 3-row verify, a 2-row cold round
CHAIN_MIXED = (1.0, 1.45, 1.9, 2.3, 2.7, 3.1, 3.5, 3.9, 4.3)      # Jacobi: 1 draft is a 2-row forward


def plan_with(monkeypatch, costs: tuple[float, ...]) -> None:
    table = CostTable({"test": True}, 0, tuple(costs))
    monkeypatch.setattr("studio.run.session.cost_table", lambda engine: table)


def planned(result) -> list[int]:
    """The draft count of every plan of a run, in order."""
    return [e["drafts"] for e in result.events if e["t"] == "plan"]
