#!/usr/bin/env python3
"""A project that uses pipeoffload, built outside this build one of six ways, must compile,
run, and build nothing of pipeoffload's own.

  check.py SOURCE_ROOT find_package     meson-install a lean configure of the checkout (tests,
                                        bench, samples, tools off, no CUDA) into a temporary
                                        prefix with --tags devel; check what it installed and
                                        its pkg-config file (its version VERSION's); a CMake
                                        project finds it with find_package(pipeoffload X.Y
                                        REQUIRED), X.Y VERSION's series, and gets VERSION's
                                        version; and COMPONENTS cuda fails, saying the prefix has
                                        no CUDA backend and naming -Dcuda=enabled
  check.py SOURCE_ROOT add_subdirectory a CMake project adds the checkout with add_subdirectory
                                        (the project's version VERSION's)
  check.py SOURCE_ROOT fetch_content    a CMake project gets pipeoffload with FetchContent from a
                                        file:// URL: a .tar.gz of the checkout's files (those git
                                        tracks or would track), as a release archive, with its
                                        SHA-256; no network
  check.py SOURCE_ROOT meson_subproject a Meson project with the checkout as subprojects/pipeoffload
                                        (the subproject's version VERSION's)
  check.py SOURCE_ROOT find_package_cuda BUILD_ROOT
                                        the CUDA backend from an installed prefix: meson install
                                        --no-rebuild --tags devel of the Meson build at BUILD_ROOT
                                        (its CUDA libraries already built; nothing is rebuilt)
                                        under a temporary DESTDIR; a CMake project finds it with
                                        find_package(pipeoffload X.Y REQUIRED COMPONENTS cuda)
                                        and links pipeoffload::cuda: the attention library, then
                                        the kernels library, then every NVIDIA library
                                        cmake/pipeoffloadCuda.txt lists
  check.py SOURCE_ROOT add_subdirectory_cuda BUILD_ROOT [--build]
                                        the CUDA backend from the checkout: a CMake project adds
                                        it with add_subdirectory and -DPIPEOFFLOAD_CUDA=ON; check
                                        it would compile the backend's src/*.cu with nvcc
                                        for exactly the architectures cmake/pipeoffloadCuda.txt
                                        lists, as the Meson build at BUILD_ROOT does, and
                                        -std=c++20, and attention.cpp with the cuDNN frontend's
                                        headers; with
                                        --build, build it (minutes: the libraries too) and run it.
                                        SKIP where the Meson build at BUILD_ROOT has no CUDA
                                        backend (nvcc, cuDNN, NCCL or the frontend missing)

The first four build tests/consumer/project/consumer.cpp (a schedule built, validated and
simulated; two thread ranks trained) and run it. The CUDA routes build
tests/consumer/project_cuda/consumer.cpp, which calls the kernels' launchers, makes a
backend::Cuda (the attention library, cuBLASLt, cuDNN) and asks NCCL its version, so its link
proves pipeoffload::cuda; they accept its exit 77 without a GPU (the link is what is tested).
All but add_subdirectory_cuda assert the build has one target, the consumer: CMake's
compile_commands.json has one entry and `ninja -t commands` two commands (compile, link);
Meson's introspection lists one target. CMake's configure must print no warning. The CMake
projects get VERSION's version as -DPIPEOFFLOAD_EXPECT_VERSION: they ask for its series and
fail when pipeoffload's version differs. Exit 77 (skip) when cmake, ninja or meson is missing,
or (the CUDA routes) when BUILD_ROOT has no CUDA backend.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

SKIP = 77
# The CUDA backend's static libraries (src/meson.build).
CUDA_LIBRARIES = ["pipeoffload_cuda_attention", "pipeoffload_cuda_kernels"]


def version(root):
    """VERSION's version, MAJOR.MINOR.PATCH (the one place it is written)."""
    with open(os.path.join(root, "VERSION"), encoding="utf-8") as f:
        text = f.read().strip()
    if not re.fullmatch(r"\d+\.\d+\.\d+", text):
        fail(f"VERSION should hold MAJOR.MINOR.PATCH, it holds {text!r}")
    return text


def cuda_list(root, key):
    """A list of cmake/pipeoffloadCuda.txt (architectures, toolkit_libraries, separate_libraries)."""
    with open(os.path.join(root, "cmake", "pipeoffloadCuda.txt"), encoding="utf-8") as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split(":", 1)[1].split()
    fail(f"cmake/pipeoffloadCuda.txt has no line '{key}: ...'")


def gencode_flags(root):
    """The nvcc flags of the architectures cmake/pipeoffloadCuda.txt lists: real, no PTX."""
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in cuda_list(root, "architectures")]


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def run(cmd, cwd=None, env=None):
    """Runs cmd; fails the test with its output if it fails. Returns its stdout and stderr."""
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        print(p.stdout)
        fail(f"{cmd[0]} exited with {p.returncode}")
    return p.stdout


def tool(name):
    path = shutil.which(name)
    if path is None:
        print(f"SKIP: {name} is not installed (Debian: apt-get install {'ninja-build' if name == 'ninja' else name})")
        sys.exit(SKIP)
    return path


def no_warnings(output, what):
    bad = [line for line in output.splitlines() if "WARNING" in line or "DEPRECATION" in line]
    if bad:
        fail(f"{what} printed warnings:\n" + "\n".join(bad))


def cmake_consumer(cmake, ninja, root, consumer_src, build, defines, exit_codes=(0,)):
    """Configures, builds and runs the CMake consumer; asserts it is the build's only target.
    The consumer may exit with any of exit_codes. Returns the link command."""
    defines = dict(defines, PIPEOFFLOAD_EXPECT_VERSION=version(root))
    out = run([cmake, "-S", consumer_src, "-B", build, "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
               "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"] + [f"-D{k}={v}" for k, v in defines.items()])
    if "CMake Warning" in out or "CMake Deprecation Warning" in out:
        print(out)
        fail("configuring the CMake consumer printed a warning (above)")
    with open(os.path.join(build, "compile_commands.json"), encoding="utf-8") as f:
        entries = json.load(f)
    if [os.path.basename(e["file"]) for e in entries] != ["consumer.cpp"]:
        fail("the CMake build compiles more than consumer.cpp: " + ", ".join(e["file"] for e in entries))
    command = entries[0]["command"]
    stds = re.findall(r"-std=\S+", command)
    if len(stds) != 1 or not stds[0].endswith("++20"):
        fail(f"consumer.cpp should be compiled with exactly one C++20 -std flag, got {stds}: {command}")
    commands = run([ninja, "-C", build, "-t", "commands", "all"]).strip().splitlines()
    if len(commands) != 2:
        fail(f"building 'all' should take 2 commands (compile, link), it takes {len(commands)}:\n" + "\n".join(commands))
    run([ninja, "-C", build])
    run_consumer(os.path.join(build, "consumer"), exit_codes)
    return commands[-1]


def run_consumer(path, exit_codes):
    p = subprocess.run([path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(p.stdout)
    if p.returncode not in exit_codes:
        fail(f"the consumer exited with {p.returncode}")


def find_package(root, work, consumer_src):
    cmake, ninja, meson = tool("cmake"), tool("ninja"), tool("meson")
    lean, prefix = os.path.join(work, "lean"), os.path.join(work, "prefix")
    out = run([meson, "setup", lean, root, f"--prefix={prefix}", "-Dtests=false", "-Dbench=false",
               "-Dsamples=false", "-Dtools=false", "-Dcuda=disabled"])
    no_warnings(out, "configuring pipeoffload without tests, bench, samples, tools and CUDA")
    targets = json.loads(run([meson, "introspect", "--targets", lean]))
    if targets:
        fail("the lean configure still defines targets: " + ", ".join(t["name"] for t in targets))
    run([meson, "install", "-C", lean, "--tags", "devel"])
    for rel in ["include/pipeoffload/pipeoffload.hpp", "include/pipeoffload/runtime.hpp", "lib/pkgconfig/pipeoffload.pc",
                "lib/cmake/pipeoffload/pipeoffloadConfig.cmake", "lib/cmake/pipeoffload/pipeoffloadConfigVersion.cmake"]:
        if not os.path.isfile(os.path.join(prefix, rel)):
            fail(f"meson install --tags devel did not install {rel}")
    if os.path.exists(os.path.join(prefix, "bin")):
        fail("meson install --tags devel of the lean configure installed programs: " + str(os.listdir(os.path.join(prefix, "bin"))))
    pkg_config = shutil.which("pkg-config")
    if pkg_config:
        env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(prefix, "lib", "pkgconfig"))
        cflags = run([pkg_config, "--cflags", "pipeoffload"], env=env).split()
        if f"-I{prefix}/include" not in cflags or any(f.startswith("-std=") for f in cflags):
            fail(f"pkg-config --cflags pipeoffload: expected -I{prefix}/include and no -std flag, got {cflags}")
        modversion = run([pkg_config, "--modversion", "pipeoffload"], env=env).strip()
        if modversion != version(root):
            fail(f"pkg-config --modversion pipeoffload says {modversion}, VERSION {version(root)}")
    else:
        print("pkg-config is not installed: its file is not checked")
    cmake_consumer(cmake, ninja, root, consumer_src, os.path.join(work, "consumer"), {"CMAKE_PREFIX_PATH": prefix})
    # The lean configure has no CUDA backend: asking for it must fail with a reason.
    series = ".".join(version(root).split(".")[:2])
    cuda_src = os.path.join(work, "wants_cuda")
    os.makedirs(cuda_src)
    with open(os.path.join(cuda_src, "CMakeLists.txt"), "w", encoding="utf-8") as f:
        f.write("cmake_minimum_required(VERSION 3.20)\nproject(wants_cuda LANGUAGES CXX)\n"
                f"find_package(pipeoffload {series} REQUIRED COMPONENTS cuda)\n")
    p = subprocess.run([cmake, "-S", cuda_src, "-B", os.path.join(cuda_src, "build"), "-G", "Ninja",
                        f"-DCMAKE_MAKE_PROGRAM={ninja}", f"-DCMAKE_PREFIX_PATH={prefix}"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode == 0 or "without the CUDA backend" not in p.stdout or "-Dcuda=enabled" not in p.stdout:
        print(p.stdout)
        fail(f"find_package(pipeoffload {series} REQUIRED COMPONENTS cuda) should fail saying the prefix was "
             "installed without the CUDA backend, and how to build it (-Dcuda=enabled)")


def add_subdirectory(root, work, consumer_src):
    cmake, ninja = tool("cmake"), tool("ninja")
    cmake_consumer(cmake, ninja, root, consumer_src, os.path.join(work, "consumer"), {"PIPEOFFLOAD_CHECKOUT": root})


def source_files(root):
    """The checkout's files as a release archive would hold them: what git tracks or would track
    (untracked files not ignored included, so the working tree is tested); without git, every
    file but .git and the build directories (.gitignore's /build*/)."""
    if os.path.exists(os.path.join(root, ".git")) and shutil.which("git"):
        listed = run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
        return sorted(f for f in set(listed.split("\0")) if f and os.path.isfile(os.path.join(root, f)))
    files = []
    for d, dirs, names in os.walk(root):
        if d == root:
            dirs[:] = [x for x in dirs if x != ".git" and not x.startswith("build")]
        files += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(files)


def fetch_content(root, work, consumer_src):
    cmake, ninja = tool("cmake"), tool("ninja")
    archive = os.path.join(work, "pipeoffload.tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        for f in source_files(root):
            tar.add(os.path.join(root, f), arcname=os.path.join("pipeoffload", f))
    with open(archive, "rb") as f:
        sha256 = hashlib.sha256(f.read()).hexdigest()
    build = os.path.join(work, "consumer")
    cmake_consumer(cmake, ninja, root, consumer_src, build,
                   {"PIPEOFFLOAD_URL": "file://" + archive, "PIPEOFFLOAD_URL_SHA256": sha256})
    if not os.path.isfile(os.path.join(build, "_deps", "pipeoffload-src", "include", "pipeoffload", "pipeoffload.hpp")):
        fail("FetchContent did not unpack the archive into _deps/pipeoffload-src")


def meson_subproject(root, work, consumer_src):
    meson, ninja = tool("meson"), tool("ninja")
    project = os.path.join(work, "project")
    os.makedirs(os.path.join(project, "subprojects"))
    for f in ["meson.build", "consumer.cpp"]:
        shutil.copy(os.path.join(consumer_src, f), project)
    os.symlink(root, os.path.join(project, "subprojects", "pipeoffload"))
    build = os.path.join(project, "build")
    out = run([meson, "setup", build, project, "--force-fallback-for=pipeoffload"])
    no_warnings(out, "configuring a project with pipeoffload as a subproject")
    names = [t["name"] for t in json.loads(run([meson, "introspect", "--targets", build]))]
    if names != ["consumer"]:
        fail(f"the Meson project should define one target, consumer; it defines {names}")
    subprojects = json.loads(run([meson, "introspect", "--projectinfo", build]))["subprojects"]
    versions = {p["name"]: p["version"] for p in subprojects}
    if versions.get("pipeoffload") != version(root):
        fail(f"the subproject pipeoffload should have VERSION's version, {version(root)}; Meson says {versions}")
    run([ninja, "-C", build])
    run_consumer(os.path.join(build, "consumer"), (0,))


def cuda_libraries(meson, build_root):
    """The CUDA backend's static libraries in the Meson build at build_root, {name: file}; exits
    77 (skip) when that build has no CUDA backend."""
    targets = json.loads(run([meson, "introspect", "--targets", build_root]))
    libs = {t["name"]: t["filename"][0] for t in targets if t["name"] in CUDA_LIBRARIES}
    if len(libs) != len(CUDA_LIBRARIES):
        print(f"SKIP: the build in {build_root} has no CUDA backend (it needs nvcc, cuDNN, NCCL and the cuDNN frontend)")
        sys.exit(SKIP)
    return libs


def find_package_cuda(root, work, consumer_src, build_root):
    cmake, ninja, meson = tool("cmake"), tool("ninja"), tool("meson")
    libs = cuda_libraries(meson, build_root)
    for path in libs.values():
        if not os.path.isfile(path):
            fail(f"{path} is not built (meson test builds it first: the test depends on it)")
    # The build's devel files, without building anything else, under DESTDIR + its prefix.
    options = {o["name"]: o["value"] for o in json.loads(run([meson, "introspect", "--buildoptions", build_root]))}
    destdir = os.path.join(work, "destdir")
    run([meson, "install", "-C", build_root, "--no-rebuild", "--tags", "devel", "--destdir", destdir])
    prefix = os.path.join(destdir, os.path.relpath(options["prefix"], "/"))
    libdir = os.path.join(prefix, options["libdir"])  # an absolute libdir replaces the prefix
    installed = [os.path.join(libdir, os.path.basename(path)) for path in
                 (libs["pipeoffload_cuda_attention"], libs["pipeoffload_cuda_kernels"])]
    cmake_dir = os.path.join(prefix, "lib", "cmake", "pipeoffload")
    package = [os.path.join(cmake_dir, f) for f in ["pipeoffloadCudaLibraries.cmake", "pipeoffloadCuda.txt"]]
    for path in installed + package:
        if not os.path.isfile(path):
            fail(f"meson install --tags devel did not install {os.path.relpath(path, destdir)}")
    if os.path.exists(os.path.join(prefix, options["bindir"])):
        fail("meson install --tags devel installed programs: " + str(os.listdir(os.path.join(prefix, options["bindir"]))))
    link = cmake_consumer(cmake, ninja, root, consumer_src, os.path.join(work, "consumer"),
                          {"CMAKE_PREFIX_PATH": prefix}, exit_codes=(0, SKIP))
    # Attention's library before the kernels', both before the NVIDIA libraries they call: every
    # one cmake/pipeoffloadCuda.txt lists.
    nvidia = cuda_list(root, "toolkit_libraries") + cuda_list(root, "separate_libraries")
    at = [link.find(path) for path in installed] + [link.find(f"lib{name}.") for name in nvidia]
    if -1 in at or at[0] > at[1] or max(at[:2]) > min(at[2:]):
        fail("the consumer's link should name the attention library, the kernels library, then " + ", ".join(nvidia) +
             ": " + link)


def add_subdirectory_cuda(root, work, consumer_src, build_root):
    cmake, ninja, meson = tool("cmake"), tool("ninja"), tool("meson")
    cuda_libraries(meson, build_root)  # skips where Meson found no CUDA backend to build
    build = os.path.join(work, "consumer")
    out = run([cmake, "-S", consumer_src, "-B", build, "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
               "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", f"-DPIPEOFFLOAD_CHECKOUT={root}",
               f"-DPIPEOFFLOAD_EXPECT_VERSION={version(root)}"])
    if "CMake Warning" in out or "CMake Deprecation Warning" in out:
        print(out)
        fail("configuring the CMake consumer with -DPIPEOFFLOAD_CUDA=ON printed a warning (above)")
    with open(os.path.join(build, "compile_commands.json"), encoding="utf-8") as f:
        commands = {os.path.basename(e["file"]): e["command"] for e in json.load(f)}
    kernels = ["elementwise.cu", "ops_elementwise.cu", "ops_rows.cu", "reduce.cu"]
    if sorted(commands) != sorted(["attention.cpp", "consumer.cpp"] + kernels):
        fail("the CMake build should compile consumer.cpp and the library's src/attention.cpp, " +
             ", ".join(kernels) + "; it compiles " + ", ".join(sorted(commands)))
    # The same architectures in both builds: exactly those the list names, nothing CMake or
    # Meson adds of their own.
    wanted = gencode_flags(root) + ["-std=c++20"]
    with open(os.path.join(build_root, "compile_commands.json"), encoding="utf-8") as f:
        meson_commands = {os.path.basename(e["file"]): e["command"] for e in json.load(f)
                          if os.path.basename(e["file"]) in kernels}
    for name in kernels:
        for build_system, command in [("CMake", commands[name]), ("Meson", meson_commands.get(name, ""))]:
            flags = [f for f in command.split() if f.startswith(("-gencode", "-arch", "--generate-code", "-std"))]
            if sorted(flags) != sorted(wanted):
                fail(f"{build_system} should compile {name} with exactly {' '.join(wanted)}: {command}")
    frontend = run([sys.executable, os.path.join(root, "src", "find_cudnn_frontend.py")]).strip()
    if frontend not in commands["attention.cpp"]:
        fail(f"attention.cpp should be compiled with the cuDNN frontend's headers ({frontend}): {commands['attention.cpp']}")
    if "--build" in sys.argv:
        run([ninja, "-C", build, "-j2"])  # attention.cpp alone takes about 4 GB
        run_consumer(os.path.join(build, "consumer"), (0, SKIP))


def main():
    routes = {"find_package": find_package, "add_subdirectory": add_subdirectory, "fetch_content": fetch_content,
              "meson_subproject": meson_subproject}
    cuda_routes = {"find_package_cuda": find_package_cuda, "add_subdirectory_cuda": add_subdirectory_cuda}
    args = [a for a in sys.argv[1:] if a != "--build"]
    if not ((len(args) == 2 and args[1] in routes) or (len(args) == 3 and args[1] in cuda_routes)):
        print("usage: check.py SOURCE_ROOT " + "|".join(routes) + "\n       check.py SOURCE_ROOT " +
              "|".join(cuda_routes) + " BUILD_ROOT [--build]", file=sys.stderr)
        return 2
    root = os.path.abspath(args[0])
    work = tempfile.mkdtemp(prefix=f"pipeoffload-consumer-{args[1]}-")
    try:
        if args[1] in routes:
            routes[args[1]](root, work, os.path.join(root, "tests", "consumer", "project"))
        else:
            cuda_routes[args[1]](root, work, os.path.join(root, "tests", "consumer", "project_cuda"),
                                 os.path.abspath(args[2]))
    except SystemExit as e:
        if e.code == SKIP:  # a skip leaves nothing worth keeping
            shutil.rmtree(work)
        raise
    shutil.rmtree(work)  # kept when a check fails (fail() exits before this)
    print(f"consumer via {args[1]}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
