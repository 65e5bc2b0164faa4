"""The fleet: many flyserve replicas as a rollout controller and an operator see them through Prometheus.

flyserve adds no fleet controller: Argo Rollouts or Flagger rolls a thresholds change, Prometheus
holds the numbers. This package says which numbers (docs/fleet.md):

* ``promql``: the per-replica expressions (kernel time per token, regret, fallback ratio, late
  applies, version and content fingerprint), one builder per number, for any window;
* ``rules``: config/fleet_rules.yml, the recording rules built from them (``flyserve fleet rules``
  prints it; a test checks the file is what it prints);
* ``queries``: the canary-vs-stable analysis queries the deploy/ templates carry verbatim;
* ``status``: ``flyserve fleet status``, each replica's numbers and which ones disagree.

It imports telemetry (the metric names) and printable; nothing imports it but the CLI.
"""
