"""The build step that ships the top-level YAML folders inside the package.

configs/, sweeps/, clusters/ and reports/ stay at the repository's top level (where a checkout and an
editable install read them); a wheel carries them as `pdmctl/_data/<folder>` (pdmctl.resources finds them
there). Everything else about the package is declared in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# the same folders and patterns as pdmctl.resources.PATTERNS (reports/ also holds rendered reports)
DATA = {"configs": "**/*.yaml", "sweeps": "*.yaml", "clusters": "*.yaml", "reports": "*.yaml"}


class BuildWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install reads the checkout's folders
            return
        for folder, pattern in DATA.items():
            source = ROOT / folder
            for path in sorted(source.glob(pattern)):
                if path.is_file():
                    target = Path(self.build_lib, "pdmctl", "_data", folder, path.relative_to(source))
                    self.mkpath(str(target.parent))
                    self.copy_file(str(path), str(target))


setup(cmdclass={"build_py": BuildWithData})
