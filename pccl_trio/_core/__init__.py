"""The sans-IO core: wire codec, message records, the master state machine, ring math.

Nothing in this package does IO or reads a clock: it takes bytes, events and the
current time as inputs and returns frames and actions. A test enforces that no module
here imports trio, socket, time or threading.
"""
