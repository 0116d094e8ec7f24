"""`pdserve chaos`: steady greedy load on a cluster while its workers are SIGKILLed and SIGSTOPped one at a time,
then a count of what the clients got (see docs/chaos.md)."""
