// Engine: job queues, budgets, deadlines, poll/wait, memory regions; and
// JobResult, the one completion record of every job (host copy, disk,
// remote, CUDA). The submit_* of each medium are added by its own file.
#include "../core/engine.h"

#include "bindings.h"

namespace kvtier::bindings {

namespace {

template <typename M>
struct field {
  const char* name;
  M JobResult::*member;
};
template <typename M>
field(const char*, M JobResult::*) -> field<M>;
template <typename... M>
void readonly(py::class_<JobResult>& cls, field<M>... f) {
  (cls.def_readonly(f.name, f.member), ...);
}

QueueOptions queue_options(const py::tuple& t) {
  // (budget_bytes, serial[, deadline_seconds])
  if (t.size() != 2 && t.size() != 3)
    throw Error(StatusCode::kInvalidArgument,
                "a queue is (budget_bytes, serial[, deadline_seconds])");
  QueueOptions o;
  o.budget_bytes = t[0].cast<std::uint64_t>();
  o.serial = t[1].cast<bool>();
  if (t.size() == 3) {
    const double d = t[2].cast<double>();
    if (!(d >= 0)) throw Error(StatusCode::kInvalidArgument, "deadline must be >= 0");
    o.deadline = std::chrono::milliseconds(static_cast<std::int64_t>(d * 1000));
  }
  return o;
}
}  // namespace

EngineClass bind_engine(py::module_& m) {
  py::class_<JobResult> result(m, "JobResult");
  readonly(result, field{"job_id", &JobResult::job_id}, field{"ok", &JobResult::ok},
           field{"error", &JobResult::error}, field{"nbytes", &JobResult::nbytes},
           field{"seconds", &JobResult::seconds}, field{"items", &JobResult::items},
           field{"timed_out", &JobResult::timed_out}, field{"held", &JobResult::held},
           field{"released", &JobResult::released});
  result
      .def("__iter__",
           [](const JobResult& r) {
             return py::iter(py::make_tuple(r.job_id, r.ok, r.error, r.nbytes, r.seconds));
           })
      .def("__repr__", [](const JobResult& r) {
        return "JobResult(job_id=" + std::to_string(r.job_id) +
               ", ok=" + (r.ok ? "True" : "False") + ", error='" + r.error +
               "', nbytes=" + std::to_string(r.nbytes) + ", seconds=" + std::to_string(r.seconds) +
               ")";
      });

  EngineClass engine(m, "Engine");
  engine
      .def(py::init([](std::size_t num_threads, const std::vector<py::tuple>& qs, int nice) {
             std::vector<QueueOptions> opts;
             for (const auto& t : qs) opts.push_back(queue_options(t));
             return std::make_unique<Engine>(num_threads, std::move(opts), nice);
           }),
           py::arg("num_threads"), py::arg("queues"), py::arg("nice") = 0)
      .def(
          "submit_sleep",
          [](Engine& e, double seconds, std::uint64_t nbytes, const std::string& fail,
             std::size_t queue) {
            if (seconds < 0) throw Error(StatusCode::kInvalidArgument, "seconds must be >= 0");
            auto ms = std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
            return submit_or_busy(e, make_sleep_job(ms, nbytes, fail), queue);
          },
          py::arg("seconds"), py::arg("nbytes") = 0, py::arg("fail") = "", py::arg("queue") = 0)
      .def("poll", &Engine::poll)
      .def(
          "wait",
          [](Engine& e, const std::vector<std::uint64_t>& ids, double timeout) {
            wait_interruptibly([&](std::chrono::milliseconds s) { return e.wait_for(ids, s); },
                               timeout, "wait: " + std::to_string(ids.size()) + " job(s)");
          },
          py::arg("job_ids"), py::arg("timeout") = -1.0)
      .def(
          "close",
          [](Engine& e, bool cancel) {
            py::gil_scoped_release nogil;
            e.close(cancel);
          },
          py::arg("cancel") = false)
      .def_property_readonly("closed", &Engine::closed)
      .def_property_readonly("num_threads", &Engine::num_threads)
      .def_property_readonly("nice", &Engine::nice)
      .def("in_flight_bytes", &Engine::in_flight_bytes, py::arg("queue") = 0)
      .def("register_region", &Engine::register_region, py::arg("address"), py::arg("nbytes"))
      .def(
          "unregister_region",
          [](Engine& e, std::uintptr_t addr) {
            py::gil_scoped_release nogil;
            e.unregister_region(addr);
          },
          py::arg("address"));
  return engine;
}

}  // namespace kvtier::bindings
