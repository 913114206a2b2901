"""The exspec Triton backend: a thin adapter between Triton's decoupled Python API and LLMEngine.

This file is Triton's table of contents; each part has its own module:
- exspec_intake: Triton's thread calls `execute`, which parses each request, registers it with
  the send thread, hands it to the engine and returns None at once;
- exspec_engine_thread: the engine thread runs ticks (`engine.step()`) and queues each tick's
  outputs together with a stats snapshot; it never sends;
- exspec_send: the send thread owns every in-flight request's state: it turns outputs into
  responses, polls cancellations, aborts cancelled requests and updates the metrics;
- exspec_lifecycle: the drain, the tick watchdog and the orphan guard;
- exspec_config (what the model reads at load), exspec_request (parsing), exspec_responses (what
  is sent), exspec_messages (the send queue's items), exspec_stream (one request's state),
  exspec_metrics, exspec_log (the log, written by one owner thread: the send thread while it runs),
  exspec_traffic (model.json's record_traffic: served requests as the offline replay reads them,
  written by a thread of its own).
While the model serves, only the send thread calls Triton's metrics, response senders and logger.
No decoding or scheduling lives here (design: "The Triton adapter" has the contract and the
response rules).
"""
from __future__ import annotations

import json
import logging
import queue

import triton_python_backend_utils as pb_utils

from exspec.engine.llm_engine import LLMEngine
from exspec_config import (drain_settings, engine_config, parameter, traffic_recording,
                           unload_when_dead, vllm_health_check, vllm_stats_disabled)
from exspec_engine_thread import EngineThread
from exspec_intake import INPUTS, Intake
from exspec_lifecycle import FINALIZE_DRAIN_S, Lifecycle, start_orphan_guard
from exspec_log import EngineLog, Log
from exspec_metrics import Metrics
from exspec_responses import OUTPUTS
from exspec_send import SendThread
from exspec_traffic import TrafficLog


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        present = config.as_dict()
        have_in = {i["name"] for i in present.get("input", [])}
        have_out = {o["name"] for o in present.get("output", [])}
        for spec in INPUTS:
            if spec["name"] not in have_in:
                config.add_input(spec)
        for spec in OUTPUTS:
            if spec["name"] not in have_out:
                config.add_output(spec)
        config.set_model_transaction_policy({"decoupled": True})
        config.set_max_batch_size(0)
        return config

    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise ValueError("the exspec backend streams: set model_transaction_policy "
                             "{ decoupled: true } in config.pbtxt (or leave it out)")
        self.model_name = args["model_name"]
        config = engine_config(args)
        recording = traffic_recording(args)
        self.traffic = TrafficLog(recording) if recording else None   # opened: a bad path fails now
        unload = self.model_name if unload_when_dead(self.model_config) else None
        vllm_words = vllm_health_check(self.model_config)
        pb_utils.Logger.log_info(f"exspec: loading {config}")
        self.sends = queue.Queue()   # everything the send thread handles
        self.log = Log(self.sends)
        self.engine_log = EngineLog(self.log)
        engine_logger = logging.getLogger("exspec")
        engine_logger.addHandler(self.engine_log)
        if engine_logger.level == logging.NOTSET:   # its info lines too (Python's default: warnings up)
            engine_logger.setLevel(logging.INFO)
        try:
            self.engine = LLMEngine(config)
        except BaseException:   # what other threads logged, written here: no send thread will
            engine_logger.removeHandler(self.engine_log)
            self.log.write_queued()
            raise
        self.metrics = self._metrics(args)
        self.lifecycle = Lifecycle(*drain_settings(self.model_config), config.tick_timeout_s,
                                   self.log, unload, vllm_words)
        self.engine_thread = EngineThread(self.engine, self.sends, self.lifecycle, self.log)
        k = config.num_speculative_tokens if config.speculative else 0
        self.send_thread = SendThread(self.sends, self.engine, self.engine_thread,
                                      self.lifecycle, self.metrics, self.log, k, self.traffic)
        self.intake = Intake(self.engine, self.sends, self.lifecycle, self.log,
                             per_token=config.stream_granularity == "token")
        self.log.hand_over()   # to the send thread: from here on this thread's lines queue too
        self.engine_thread.start()
        if self.traffic is not None:
            self.traffic.start()
        self.send_thread.start()
        start_orphan_guard(self.model_name)
        self._log_ready(config)

    def _metrics(self, args) -> Metrics:
        # REPORT_CUSTOM_METRICS: the vLLM backend's switch for its vllm: families (which vLLM's
        # disable_log_stats turns off there too)
        report_vllm = (parameter(self.model_config, "REPORT_CUSTOM_METRICS").lower() == "true"
                       and not vllm_stats_disabled(args))
        return Metrics(self.model_name, args["model_version"],
                       self.engine.max_model_len if report_vllm else None)

    def _log_ready(self, config):
        warm = self.engine.warm_up
        path = "eager" if warm is None else f"compiled ({warm.describe()})"
        recording = (f", recording served traffic to {self.traffic.path} (record_traffic)"
                     if self.traffic is not None else "")
        self.log.info(f"exspec: model {self.model_name} ready on {config.device}, "
                                 f"{self.engine.threads.describe()}, decode path {path}{recording}")

    def execute(self, requests):
        for request in requests:
            self.intake.take(request)
        return None

    def is_ready(self):
        """/v2/models/<model>/ready on Triton 26.03 and later (older ones never ask): not ready
        once the engine stopped or while draining, so load balancers and Kubernetes stop
        sending requests here. The exspec:engine_up gauge says the same on any version."""
        return self.lifecycle.ready

    def finalize(self):
        """Bounded: drain (stop intake, let in-flight requests finish until the drain deadline,
        end the rest with an error), wait for the pool to empty, join threads with timeouts."""
        self.intake.close()
        self.lifecycle.drain_for_unload(self.sends)
        engine_ended = self.engine_thread.stop(grace_s=FINALIZE_DRAIN_S)
        send_ended = self.send_thread.stop(engine_ended)
        if self.traffic is not None:
            self.traffic.close()
        logging.getLogger("exspec").removeHandler(self.engine_log)
        if send_ended:   # the log is this thread's now: what reached the queue late, then its own
            self.log.take()
            self.log.write_queued()
        self.log.info(f"exspec: model {self.model_name} finalized")
