"""`pdserve bench`, the load-test client.

  workload  seeded request sequences (Poisson or gamma arrivals, length ranges, JSONL datasets)
  runner    the asyncio gRPC client that sends them at their arrival times and times each one
  stats     percentiles, throughput and goodput
  report    summary text, the JSON document with the run's conditions, PNG charts
  cli       the `bench` subcommand (add_bench)
Imports neither torch nor numpy; matplotlib only when a chart is written.
"""
