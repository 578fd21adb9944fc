from ._doctor import BadBatchError, BatchFinding, Finding, check_batch, doctor, format_findings
