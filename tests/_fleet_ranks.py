"""A rank of ``test_fleet_failures``'s manager-driven test as a Ray actor: ``_ray_ranks.Rank`` plus
:meth:`FleetRank.run`, which runs a snippet of the test (verl's worker method on a rollout rank, the
engine's send on the trainer) with the rank's worker in scope. In a module of its own: Ray imports an
actor's class by module name in the actor's process."""

from __future__ import annotations

from typing import Any

from _ray_ranks import Rank  # type: ignore[import-not-found]


class FleetRank:
    """A rank as a Ray actor (``_ray_ranks.Rank``) whose rollout side runs verl's own worker method
    (``_verl_receive.verl_update_weights``) and whose trainer side reports its error and end time."""

    def __init__(self, transport: str, ctor: dict[str, Any], role: str) -> None:
        self.rank = Rank(transport, ctor, role)

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.rank.execute_checkpoint_engine(method, *args, **kwargs)

    def run(self, code: str) -> Any:
        namespace: dict[str, Any] = {"worker": self.rank.worker}
        exec(code, namespace)
        return namespace["result"]
