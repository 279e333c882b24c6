"""Fault injection for radixkv: the soak run (`python -m tests.soak`, `make soak`) and the
kit the fault tests in tests/service share with it.

- The daemons are `tests.support.daemon.DaemonProcess`: real daemons in subprocesses on
  temporary unix sockets that can be SIGKILLed and restarted on the same socket.
- `engine.ChaosEngine`: a simulated engine that survives daemon restarts and verifies
  every byte it is told is valid.
- `runner`: several engine processes, daemon and engine kills, RSS samples, a report.
"""
