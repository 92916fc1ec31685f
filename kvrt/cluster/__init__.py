"""kvrt past one host: kvrt HTTP servers as Ray Serve replicas, requests routed by agent and prefix affinity.

Each replica (:mod:`kvrt.cluster.replica`) runs the server ``kvrt serve --http`` runs, on its own engines;
Ray Serve's HTTP proxy hands every request to the ingress (:mod:`kvrt.cluster.ingress`), which reads its
route (:mod:`kvrt.cluster.affinity`: the agent, else the prompt's opening) and relays it through a
deployment handle whose request router (:mod:`kvrt.cluster.router`) picks the replica by rendezvous hashing
over the live replicas. :func:`kvrt.cluster.app.build` puts them together; Ray Serve starts, restarts and
scales the replicas. Needs the ``cluster`` extra (``ray[serve]``); nothing else in kvrt imports this package.
"""
