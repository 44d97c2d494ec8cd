package guest

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strings"
)

// Kernel is an installed Debian kernel: its image and its modules folder.
type Kernel struct {
	Version string // e.g. 6.1.0-57-cloud-amd64
	Image   string // /boot/vmlinuz-VERSION
	Modules string // /lib/modules/VERSION
}

// FindKernel returns the newest kernel under /boot that has its modules
// installed: linux-image-cloud-amd64, which scripts/test.sh installs.
func FindKernel() (Kernel, error) {
	images, err := filepath.Glob("/boot/vmlinuz-*")
	if err != nil {
		return Kernel{}, fmt.Errorf("guest: listing /boot: %w", err)
	}
	sort.Strings(images)
	for i := len(images) - 1; i >= 0; i-- {
		v := strings.TrimPrefix(filepath.Base(images[i]), "vmlinuz-")
		mods := filepath.Join("/lib/modules", v)
		if _, err := os.Stat(filepath.Join(mods, "modules.dep")); err == nil {
			return Kernel{Version: v, Image: images[i], Modules: mods}, nil
		}
	}
	return Kernel{}, errors.New("guest: no kernel in /boot with its modules in /lib/modules; run scripts/test.sh, which installs linux-image-cloud-amd64")
}

// guestModules are the drivers the guest needs for its disk and serial
// ports; ext4 too, which Debian builds in (then it is not loaded).
var guestModules = []string{"virtio_pci", "virtio_blk", "ext4"}

// moduleOrder returns the module files (relative to dir) that load names
// and their dependencies, every dependency before its users, read from
// dir/modules.dep. A name built into the kernel (modules.builtin) is left
// out; a name in neither file is an error.
func moduleOrder(dir string, names []string) ([]string, error) {
	deps, err := readModulesDep(filepath.Join(dir, "modules.dep"))
	if err != nil {
		return nil, err
	}
	builtin := map[string]bool{}
	if b, err := os.ReadFile(filepath.Join(dir, "modules.builtin")); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			builtin[moduleName(l)] = true
		}
	}
	byName := map[string]string{}
	for f := range deps {
		byName[moduleName(f)] = f
	}
	var (
		order []string
		done  = map[string]bool{}
		visit func(f string, depth int) error
	)
	visit = func(f string, depth int) error {
		if done[f] {
			return nil
		}
		if depth > 64 {
			return fmt.Errorf("guest: modules.dep: dependency loop at %s", f)
		}
		for _, d := range deps[f] {
			if err := visit(d, depth+1); err != nil {
				return err
			}
		}
		done[f] = true
		order = append(order, f)
		return nil
	}
	for _, n := range names {
		n = strings.ReplaceAll(n, "-", "_")
		f, ok := byName[n]
		switch {
		case ok:
			if err := visit(f, 0); err != nil {
				return nil, err
			}
		case builtin[n]:
		default:
			return nil, fmt.Errorf("guest: module %s is neither in %s/modules.dep nor built in", n, dir)
		}
	}
	for _, f := range order {
		if !strings.HasSuffix(f, ".ko") {
			// busybox insmod reads only what its build enabled; the
			// cloud kernel's modules are not compressed.
			return nil, fmt.Errorf("guest: module %s is compressed; only plain .ko files are loaded", f)
		}
	}
	return order, nil
}

// readModulesDep parses modules.dep: "file: dep dep ...".
func readModulesDep(p string) (map[string][]string, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, fmt.Errorf("guest: reading %s: %w", p, err)
	}
	deps := map[string][]string{}
	for i, l := range strings.Split(string(b), "\n") {
		if strings.TrimSpace(l) == "" {
			continue
		}
		f, rest, ok := strings.Cut(l, ":")
		if !ok {
			return nil, fmt.Errorf("guest: %s line %d: no colon in %q", p, i+1, l)
		}
		deps[f] = strings.Fields(rest)
	}
	return deps, nil
}

// moduleName is a module file's name as modprobe matches it.
func moduleName(file string) string {
	n := path.Base(strings.TrimSpace(file))
	if i := strings.Index(n, ".ko"); i >= 0 {
		n = n[:i]
	}
	return strings.ReplaceAll(n, "-", "_")
}

// hostTools are the host's e2fsprogs binaries copied into the guest with
// their shared libraries (busybox has no ext4 mkfs and no fsck).
var hostTools = []string{"mke2fs", "e2fsck"}

// findTool looks a tool up on PATH, then in the sbin folders a non-root
// PATH may lack.
func findTool(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, d := range []string{"/usr/sbin", "/sbin", "/usr/bin", "/bin"} {
		p := filepath.Join(d, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() {
			return p, nil
		}
	}
	return "", fmt.Errorf("guest: %s is not installed; run scripts/test.sh", name)
}

// sharedLibs returns the shared libraries ldd lists for bin, as the paths
// the dynamic loader looks them up at (the loader itself included).
func sharedLibs(bin string) ([]string, error) {
	out, err := exec.Command("ldd", bin).Output()
	if err != nil {
		return nil, fmt.Errorf("guest: ldd %s: %w", bin, err)
	}
	var libs []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) >= 3 && f[1] == "=>" && strings.HasPrefix(f[2], "/"):
			libs = append(libs, f[2])
		case len(f) >= 1 && strings.HasPrefix(f[0], "/"):
			libs = append(libs, f[0])
		case len(f) >= 3 && f[1] == "=>" && f[2] == "not":
			return nil, fmt.Errorf("guest: ldd %s: %s not found", bin, f[0])
		}
	}
	return libs, nil
}

// BuildInitramfs writes an uncompressed newc initramfs to dst: busybox,
// the host's mke2fs and e2fsck with their libraries, the kernel modules
// for a virtio disk, an /init that loads them and sets up the control port
// (see doc.go), and script, which /init runs.
func BuildInitramfs(dst string, k Kernel, script string, answerTimeoutSec int) error {
	if answerTimeoutSec <= 0 {
		return fmt.Errorf("guest: answer timeout %d s: must be positive", answerTimeoutSec)
	}
	mods, err := moduleOrder(k.Modules, guestModules)
	if err != nil {
		return err
	}
	busybox, err := findTool("busybox")
	if err != nil {
		return fmt.Errorf("%w (busybox-static)", err)
	}
	files := map[string]string{"/bin/busybox": busybox} // guest path: host path
	for _, t := range hostTools {
		p, err := findTool(t)
		if err != nil {
			return fmt.Errorf("%w (e2fsprogs)", err)
		}
		files["/sbin/"+t] = p
		libs, err := sharedLibs(p)
		if err != nil {
			return err
		}
		for _, l := range libs {
			files[l] = l
		}
	}
	var modPaths []string
	for _, m := range mods {
		gp := path.Join("/lib/modules", k.Version, m)
		files[gp] = filepath.Join(k.Modules, m)
		modPaths = append(modPaths, gp)
	}
	if _, err := os.Stat("/etc/mke2fs.conf"); err == nil {
		files["/etc/mke2fs.conf"] = "/etc/mke2fs.conf"
	}

	out, err := os.Create(dst)
	if err != nil {
		return fmt.Errorf("guest: initramfs: %w", err)
	}
	cw := newCPIOWriter(out)
	dirs := map[string]bool{}
	var mkdirs func(d string) error
	mkdirs = func(d string) error {
		if d == "/" || dirs[d] {
			return nil
		}
		if err := mkdirs(path.Dir(d)); err != nil {
			return err
		}
		dirs[d] = true
		return cw.Dir(d)
	}
	add := func(gp string, perm uint32, data []byte) error {
		if err := mkdirs(path.Dir(gp)); err != nil {
			return err
		}
		return cw.File(gp, perm, data)
	}
	for _, d := range []string{"/bin", "/sbin", "/etc", "/proc", "/sys", "/dev", "/tmp", "/mnt"} {
		if err := mkdirs(d); err != nil {
			out.Close()
			return err
		}
	}
	guestPaths := make([]string, 0, len(files))
	for gp := range files {
		guestPaths = append(guestPaths, gp)
	}
	sort.Strings(guestPaths)
	for _, gp := range guestPaths {
		// The real file under the name the loader or script asks for:
		// ldd names the sonames' symlinks.
		data, err := os.ReadFile(files[gp])
		if err != nil {
			out.Close()
			return fmt.Errorf("guest: initramfs: %w", err)
		}
		if err := add(gp, 0o755, data); err != nil {
			out.Close()
			return err
		}
	}
	links := [][2]string{
		{"/bin/sh", "busybox"},
		{"/sbin/mkfs.ext4", "mke2fs"},
		{"/sbin/fsck.ext4", "e2fsck"},
	}
	for _, l := range links {
		if err := cw.Symlink(l[0], l[1]); err != nil {
			out.Close()
			return err
		}
	}
	if err := add("/init", 0o755, []byte(initScript(modPaths, answerTimeoutSec))); err != nil {
		out.Close()
		return err
	}
	if err := add("/script", 0o644, []byte(script)); err != nil {
		out.Close()
		return err
	}
	if err := cw.Close(); err != nil {
		out.Close()
		return err
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("guest: initramfs: %w", err)
	}
	return nil
}
