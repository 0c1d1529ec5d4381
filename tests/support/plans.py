"""Cost-aware plans for tests: runs plan with a given cost table instead of this machine's, so each plan follows
from the table and the run's verdicts alone (and a test can ask for plans that change along a run)."""
from studio.engine.cost_table import CostTable

# fresh, a slot reads 0.79 (its prior 0.5, optimistically) and one draft pays; after a rejection it reads 0.57 and
# none does: plans switch along a run
ISD_MIXED = (1.0, 1.35, 1.5, 1.8, 2.0, 2.3, 2.6, 2.9, 3.2)     # ISD: 1 draft is a 3-row verify, a 2-row cold round
CHAIN_MIXED = (1.0, 1.68, 2.4, 3.0, 3.6, 4.2, 4.8, 5.4, 6.0)   # Jacobi: 1 draft is a 2-row forward


def plan_with(monkeypatch, costs: tuple[float, ...]) -> None:
    table = CostTable({"test": True}, 0, tuple(costs))
    monkeypatch.setattr("studio.run.session.cost_table", lambda engine: table)


def planned(result) -> list[int]:
    """The draft count of every plan of a run, in order."""
    return [e["drafts"] for e in result.events if e["t"] == "plan"]
