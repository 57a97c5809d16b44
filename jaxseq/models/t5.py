# Work in progress: replaced by the real family.
from jaxseq.models.family import Family

FAMILY = Family(model_type="t5", tasks={})
