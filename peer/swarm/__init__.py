"""The swarm as the trainer's port sees it: hivemind's DHT and the exact averager, the run's
records, the electorate, the swarm's pace, the bootstrap peers."""
