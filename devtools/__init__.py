"""Harness code for the demo, the end-to-end tests and the benchmarks: a real Airflow deployment
under a temporary AIRFLOW_HOME (:mod:`.airflow_env`), the demo (:mod:`.demo`, ``make demo``) and
a launcher that runs every "host" of a spanning segment on this machine (:mod:`.span`). Not part
of the installed library."""
