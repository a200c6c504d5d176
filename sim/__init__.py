"""PDS-fleet simulator: N hosts × M accounts with real repos, a PLC directory, fault injection.

See :mod:`sim.fleet` for the API, :mod:`sim.faults` for the fault modes and the
weather, :mod:`sim.weather` for the slow or failing identity services.
"""

from sim.faults import EXPECTED, FAULT_KINDS
from sim.fleet import SimConfig, SimFleet, TruthEvent
from sim.host import SimAccount, SimHost
from sim.plc import SimPLC
from sim.weather import Delay, HandleWeather, SimDNS

__all__ = ["EXPECTED", "FAULT_KINDS", "Delay", "HandleWeather", "SimAccount", "SimConfig", "SimDNS", "SimFleet",
           "SimHost", "SimPLC", "TruthEvent"]
