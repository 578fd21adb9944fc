from ._batch import BadBatchError, BatchFinding, check_batch
from ._doctor import Finding, doctor, format_findings
