"""PDS-fleet simulator: N hosts × M accounts with real repos, a PLC directory, fault injection.

See :mod:`relay.sim.fleet` for the API and :mod:`relay.sim.faults` for the fault modes.
"""

from relay.sim.faults import EXPECTED, FAULT_KINDS
from relay.sim.fleet import SimAccount, SimConfig, SimFleet, TruthEvent
from relay.sim.host import SimHost
from relay.sim.plc import SimPLC

__all__ = ["EXPECTED", "FAULT_KINDS", "SimAccount", "SimConfig", "SimFleet", "SimHost", "SimPLC", "TruthEvent"]
