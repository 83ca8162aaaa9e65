"""Parameter servers: colocated and dedicated (:mod:`.strategy`), the server loop (:mod:`.server`),
the worker-server links (:mod:`.links`) and the server's checkpoint (:mod:`.checkpoint`)."""
