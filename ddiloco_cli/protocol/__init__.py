"""The bucket protocol: keys, records, the ledger, signatures, published versions, run.json."""
