"""The Grafana dashboards as code (build) and `flyserve dashboards` (cli)."""
