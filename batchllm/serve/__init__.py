"""`batchllm serve`: OpenAI's Files and Batches API on this machine's models.

`files` keeps uploaded and produced files; `batches` is the batch lifecycle (one record per
batch, its status the one truth of where it is, persisted atomically); `validation` reads an
uploaded request file before it runs; `worker` runs the batches queued together as one group
(`run_groups`: one DAG, one run folder) through `openai_batch.run_batches` in a child process
(`runner`, `child`), so a cancel or a shutdown stops it cleanly and a restart resumes its run
folder; `outcome` writes a batch's output and error files; `app` is the FastAPI routes; `page`
the HTML page.
"""
