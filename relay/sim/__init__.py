"""PDS-fleet simulator: N hosts × M accounts with real repos, a PLC directory, fault injection.

See :mod:`relay.sim.fleet` for the API, :mod:`relay.sim.faults` for the fault modes and the
weather, :mod:`relay.sim.weather` for the slow or failing identity services.
"""

from relay.sim.faults import EXPECTED, FAULT_KINDS
from relay.sim.fleet import SimAccount, SimConfig, SimFleet, TruthEvent
from relay.sim.host import SimHost
from relay.sim.plc import SimPLC
from relay.sim.weather import Delay, HandleWeather, SimDNS

__all__ = ["EXPECTED", "FAULT_KINDS", "Delay", "HandleWeather", "SimAccount", "SimConfig", "SimDNS", "SimFleet",
           "SimHost", "SimPLC", "TruthEvent"]
