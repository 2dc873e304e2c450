// Calls into CPython's C API that import or run Python: each is rejected, however it is spelled.
#include <Python.h>

namespace corpus_c_api {

struct Api {
  decltype(&PyImport_ImportModule) import_module = nullptr;  // resolved with dlsym, like an embedding launcher
};

using RunFn = int (*)(const char*);

void imports(Api& api) {
  PyObject* a = PyImport_ImportModule("json");  // expect: python-import-from-cpp
  PyObject* b = PyImport_Import(a);  // expect: python-import-from-cpp
  PyObject* c = api.import_module("vllm.entrypoints.cli.main");  // expect: python-import-from-cpp
  Py_XDECREF(a);
  Py_XDECREF(b);
  Py_XDECREF(c);
}

int runs() {
  int rc = PyRun_SimpleString("print('hi')");  // expect: python-import-from-cpp
  RunFn run = PyRun_SimpleString;
  rc += run("x = 1");  // expect: python-import-from-cpp
  auto main_fn = &Py_RunMain;
  rc += main_fn();  // expect: python-import-from-cpp
  return rc;
}

// Named in a comment only: PyImport_ImportModule("os"); and in a string: accepted.
const char* kDoc = "PyImport_ImportModule(\"os\") and PyRun_SimpleString are never called here";

}  // namespace corpus_c_api
