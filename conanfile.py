"""Conan 2 recipe for shardkit, a header-only C++20 toolkit for sharded training over Ethernet.

The package is the headers. Each CMake target of the project (shardkit::shardkit, ::tcp, ::gloo, ::cuda, ::nccl,
::fabric, ::codec, ::ckpt, ::data, ::s3) is a component with the same cmake_target_name, so a consumer's CMake reads the same
whether it finds shardkit through Conan's CMakeDeps, an install tree or add_subdirectory.

The third-party pieces behind the optional backends come from the system, not from ConanCenter (see
docs/packaging.md, "Why the system and not ConanCenter"): `conan create .` must work offline, and Gloo, NCCL and
libfabric have no ConanCenter package that matches what a cluster's drivers were built against. A component
names its system libraries (system_libs); system_requirements() checks, with Conan's system package manager,
that the Debian/Ubuntu packages providing them are installed (mode `check` by default: it reports and fails,
it never installs unless tools.system.package_manager:mode=install).
"""
import os
import re

from conan import ConanFile
from conan.errors import ConanInvalidConfiguration
from conan.tools.build import check_min_cppstd
from conan.tools.files import copy, load
from conan.tools.layout import basic_layout
from conan.tools.system.package_manager import Apt

required_conan_version = ">=2.0"


class ShardkitConan(ConanFile):
    name = "shardkit"
    description = "Header-only C++20 toolkit for sharded training over Ethernet"
    topics = ("fsdp", "collectives", "checkpointing", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    options = {
        "with_tcp": [True, False],
        "with_gloo": [True, False],
        "with_cuda": [True, False],
        "with_nccl": [True, False],
        "with_fabric": [True, False],
        "with_ckpt": [True, False],
        "with_data": [True, False],
        "with_s3": [True, False],
    }
    # What a plain Debian 12 build machine with the project's documented packages has: Boost headers, xxHash
    # and nlohmann/json (for ckpt and data, through the codec component). Gloo, NCCL (CUDA), libfabric and libcurl are
    # opt-in.
    default_options = {
        "with_tcp": True,
        "with_gloo": False,
        "with_cuda": False,
        "with_nccl": False,
        "with_fabric": False,
        "with_ckpt": True,
        "with_data": True,
        "with_s3": False,
    }
    exports_sources = "include/*", "CMakeLists.txt"
    no_copy_source = True

    # The Debian/Ubuntu packages that provide each option's system dependency: alternatives, the first
    # complete one wins (libcurl's development files come in an OpenSSL and a GnuTLS flavour).
    _apt_packages = {
        "with_tcp": [["libboost-dev"]],
        "with_gloo": [["libgloo-dev"]],
        "with_fabric": [["libfabric-dev"]],
        "with_ckpt": [["libxxhash-dev", "nlohmann-json3-dev"]],
        "with_data": [["libxxhash-dev", "nlohmann-json3-dev"]],
        "with_s3": [["libcurl4-openssl-dev"], ["libcurl4-gnutls-dev"]],
        # NCCL and CUDA come from NVIDIA's installers or repositories, under names that vary: not checked here.
    }

    def set_version(self):
        # One version, the project()'s in CMakeLists.txt.
        text = load(self, os.path.join(self.recipe_folder, "CMakeLists.txt"))
        self.version = re.search(r"project\(shardkit VERSION ([0-9.]+)", text).group(1)

    def layout(self):
        basic_layout(self, src_folder=".")

    def package_id(self):
        # Headers only: one binary package for every setting and option. Options choose which components
        # package_info() declares, which the consumer evaluates with its own options.
        self.info.clear()

    def validate(self):
        # The consumer compiles the headers, so the consumer's standard is what must be C++20.
        # `conan profile detect` writes GCC 12's default (gnu17): say how to ask for C++20.
        if self.settings.get_safe("compiler.cppstd"):
            try:
                check_min_cppstd(self, 20)
            except ConanInvalidConfiguration as e:
                raise ConanInvalidConfiguration(
                    f"{e} Pass -s compiler.cppstd=20 (or gnu20), or set it in the profile.") from None
        if (self.options.with_nccl or self.options.with_cuda) and self.settings.os != "Linux":
            raise ConanInvalidConfiguration("shardkit's CUDA layer and NCCL backend are Linux only")

    def system_requirements(self):
        apt = Apt(self)
        for option, alternatives in self._apt_packages.items():
            if not self.options.get_safe(option):
                continue
            if len(alternatives) == 1:  # its error names the missing package
                apt.install(alternatives[0], update=False, check=True)
            else:
                apt.install_substitutes(*alternatives, update=False, check=True)

    def build(self):
        pass  # nothing to compile

    def package(self):
        copy(self, "*", src=os.path.join(self.source_folder, "include"), dst=os.path.join(self.package_folder, "include"))

    def _cuda_root(self):
        root = self.conf.get("user.shardkit:cuda_root") or os.environ.get("CUDA_HOME") or "/usr/local/cuda"
        return root

    def package_info(self):
        # CMakeDeps: find_package(shardkit CONFIG) defines one target per component below, and shardkit::all
        # (the package's own target) linking all of them. The core keeps the project's name shardkit::shardkit.
        self.cpp_info.set_property("cmake_file_name", "shardkit")
        self.cpp_info.set_property("cmake_target_name", "shardkit::all")
        self.cpp_info.set_property("pkg_config_name", "shardkit-all")

        core = self.cpp_info.components["shardkit"]
        core.set_property("cmake_target_name", "shardkit::shardkit")
        core.set_property("pkg_config_name", "shardkit")
        core.bindirs = []
        core.libdirs = []
        if self.settings.os in ("Linux", "FreeBSD"):
            # Threads::Threads in the CMake build; librt for shm_open on old glibc.
            core.system_libs = ["pthread", "rt"]
            core.cxxflags = ["-pthread"]

        def backend(name, define, system_libs=(), requires=()):
            c = self.cpp_info.components[name]
            c.set_property("cmake_target_name", f"shardkit::{name}")
            c.set_property("pkg_config_name", f"shardkit-{name}")
            c.requires = ["shardkit", *requires]
            c.defines = [define] if define else []
            c.system_libs = list(system_libs)
            c.bindirs = []
            c.libdirs = []
            c.includedirs = []  # the core's include directory is enough
            return c

        if self.options.with_tcp:
            backend("tcp", "SHARDKIT_HAS_TCP=1")  # Boost.Asio headers from the system include path
        if self.options.with_gloo:
            backend("gloo", "SHARDKIT_HAS_GLOO=1", ["gloo"])
        if self.options.with_fabric:
            backend("fabric", "SHARDKIT_HAS_FABRIC=1", ["fabric"])
        if self.options.with_ckpt or self.options.with_data:
            # xxHash64 and strict JSON; nlohmann/json is header-only, from the system.
            backend("codec", None, ["xxhash"])
        if self.options.with_ckpt:
            backend("ckpt", "SHARDKIT_HAS_CKPT=1", requires=["codec"])
        if self.options.with_data:
            backend("data", "SHARDKIT_HAS_DATA=1", requires=["codec"])
        if self.options.with_s3:
            backend("s3", "SHARDKIT_HAS_S3=1", ["curl"])
        if self.options.with_cuda or self.options.with_nccl:  # NCCL stands on the CUDA layer
            cuda = backend("cuda", "SHARDKIT_HAS_CUDA=1", ["cudart"])
            root = self._cuda_root()
            # Absolute directories: CUDA lives outside the package, where NVIDIA's installer put it.
            cuda.includedirs = [os.path.join(root, "include")]
            cuda.libdirs = [os.path.join(root, "lib64")]
        if self.options.with_nccl:
            backend("nccl", "SHARDKIT_HAS_NCCL=1", ["nccl"], requires=["cuda"])
