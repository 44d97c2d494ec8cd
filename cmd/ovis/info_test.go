package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// imageVariant builds one image in dir and returns the name to describe.
type imageVariant struct {
	name  string
	build func(t *testing.T, dir string) string
}

// step prepares or changes files in a test folder.
type step func(t *testing.T, dir string)

// after returns build preceded by steps, which make the files it needs.
func after(build func(t *testing.T, dir string) string, steps ...step) func(t *testing.T, dir string) string {
	return func(t *testing.T, dir string) string {
		t.Helper()
		for _, s := range steps {
			s(t, dir)
		}
		return build(t, dir)
	}
}

// qemuCreate returns a variant made by `qemu-img create -q args...` and
// then changed by the steps.
func qemuCreate(args string, then ...step) func(t *testing.T, dir string) string {
	return func(t *testing.T, dir string) string {
		t.Helper()
		a := strings.Fields(args)
		if r := qemuImg(t, dir, append([]string{"create", "-q"}, a...)...); r.code != 0 {
			t.Fatalf("qemu-img create %s: %s", args, r.stderr)
		}
		for _, f := range then {
			f(t, dir)
		}
		return imageArg(a)
	}
}

// ovisCreate is qemuCreate with ovis img create.
func ovisCreate(args string, then ...step) func(t *testing.T, dir string) string {
	return func(t *testing.T, dir string) string {
		t.Helper()
		a := strings.Fields(args)
		mustOvisImg(t, dir, append([]string{"create", "-q"}, a...)...)
		for _, f := range then {
			f(t, dir)
		}
		return imageArg(a)
	}
}

// imageArg picks the image name out of create arguments: the first
// argument that is neither a flag nor a flag's value.
func imageArg(a []string) string {
	for i := 0; i < len(a); i++ {
		switch {
		case a[i] == "-u" || a[i] == "-q":
		case strings.HasPrefix(a[i], "-"):
			i++ // the flag's value
		default:
			return a[i]
		}
	}
	return ""
}

// run returns a step that runs a qemu tool in the image folder.
func run(tool string, args ...string) step {
	return func(t *testing.T, dir string) {
		t.Helper()
		testutil.MustRunIn(t, dir, tool, args...)
	}
}

// infoVariants are images whose info ovis must print as qemu-img does.
func infoVariants() []imageVariant {
	write := func(img string, cmds ...string) step {
		args := []string{}
		for _, c := range cmds {
			args = append(args, "-c", c)
		}
		return run("qemu-io", append(args, img)...)
	}
	v := []imageVariant{
		{"v3", qemuCreate("-f qcow2 a.qcow2 1G")},
		{"v2", qemuCreate("-f qcow2 -o compat=0.10 a.qcow2 1G")},
		{"4k clusters", qemuCreate("-f qcow2 -o cluster_size=4k a.qcow2 1.5G")},
		{"512 clusters 64-bit refcounts", qemuCreate("-f qcow2 -o cluster_size=512,refcount_bits=64 a.qcow2 1234567")},
		{"2M clusters 1-bit refcounts", qemuCreate("-f qcow2 -o cluster_size=2M,refcount_bits=1 a.qcow2 3T")},
		{"refcount bits 8", qemuCreate("-f qcow2 -o refcount_bits=8 a.qcow2 1G")},
		{"lazy refcounts", qemuCreate("-f qcow2 -o lazy_refcounts=on a.qcow2 1G")},
		{"extended l2", qemuCreate("-f qcow2 -o extended_l2=on a.qcow2 1G")},
		{"zstd", qemuCreate("-f qcow2 -o compression_type=zstd a.qcow2 1G")},
		{"extended l2 zstd 2M", qemuCreate("-f qcow2 -o extended_l2=on,compression_type=zstd,cluster_size=2M a.qcow2 10M")},
		{"prealloc metadata", qemuCreate("-f qcow2 -o preallocation=metadata a.qcow2 10M")},
		{"data file", qemuCreate("-f qcow2 -o data_file=a.data a.qcow2 10M")},
		{"data file raw", qemuCreate("-f qcow2 -o data_file=a.data,data_file_raw=on a.qcow2 10M")},
		{"with data", qemuCreate("-f qcow2 a.qcow2 64M", write("a.qcow2", "write -P 1 0 1M", "write -z 4M 1M"))},
		{"backing qcow2", after(qemuCreate("-f qcow2 -b base.qcow2 -F qcow2 a.qcow2"),
			run("qemu-img", "create", "-q", "-f", "qcow2", "base.qcow2", "64M"))},
		{"backing raw bigger", after(qemuCreate("-f qcow2 -b base.raw -F raw a.qcow2 1G"),
			run("qemu-img", "create", "-q", "-f", "raw", "base.raw", "64M"))},
		{"backing missing", qemuCreate("-f qcow2 -u -b missing.qcow2 -F qcow2 a.qcow2 1M")},
		{"backing in parent folder", func(t *testing.T, dir string) string {
			if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
				t.Fatal(err)
			}
			run("qemu-img", "create", "-q", "-f", "qcow2", "base.qcow2", "64M")(t, dir)
			run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "../base.qcow2", "-F", "qcow2", "sub/a.qcow2")(t, dir)
			return "sub/a.qcow2"
		}},
		{"absolute path and backing", func(t *testing.T, dir string) string {
			base := filepath.Join(dir, "base.qcow2")
			run("qemu-img", "create", "-q", "-f", "qcow2", base, "64M")(t, dir)
			run("qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", "a.qcow2")(t, dir)
			return filepath.Join(dir, "a.qcow2")
		}},
		{"three-level chain", after(qemuCreate("-f qcow2 -b mid.qcow2 -F qcow2 a.qcow2"),
			run("qemu-img", "create", "-q", "-f", "raw", "base.raw", "16M"),
			run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", "mid.qcow2"))},
		{"snapshots", qemuCreate("-f qcow2 a.qcow2 64M",
			run("qemu-img", "snapshot", "-c", "snap1", "a.qcow2"),
			write("a.qcow2", "write -P 2 0 64k"),
			run("qemu-img", "snapshot", "-c", "snap two", "a.qcow2"),
			run("qemu-img", "snapshot", "-c", "späte \"quote\"", "a.qcow2"))},
		{"snapshots v2", qemuCreate("-f qcow2 -o compat=0.10 a.qcow2 64M",
			run("qemu-img", "snapshot", "-c", "s", "a.qcow2"))},
		{"snapshot then delete", qemuCreate("-f qcow2 a.qcow2 64M",
			run("qemu-img", "snapshot", "-c", "s1", "a.qcow2"),
			run("qemu-img", "snapshot", "-c", "s2", "a.qcow2"),
			run("qemu-img", "snapshot", "-d", "s1", "a.qcow2"))},
		{"dirty", qemuCreate("-f qcow2 -o lazy_refcounts=on a.qcow2 64M", func(t *testing.T, dir string) {
			// qemu-io killed mid-way leaves the dirty bit set.
			testutil.QemuIOExit(t, filepath.Join(dir, "a.qcow2"), "qcow2", "write 0 64k", "sigraise 9")
		})},
		{"corrupt flag", qemuCreate("-f qcow2 a.qcow2 64M", func(t *testing.T, dir string) {
			// Set incompatible feature bit 1 (corrupt): byte 79 of the header.
			f, err := os.OpenFile(filepath.Join(dir, "a.qcow2"), os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if _, err := f.WriteAt([]byte{2}, 79); err != nil {
				t.Fatal(err)
			}
		})},
		{"bitmaps", qemuCreate("-f qcow2 a.qcow2 64M",
			run("qemu-img", "bitmap", "--add", "a.qcow2", "b0"),
			run("qemu-img", "bitmap", "--add", "-g", "128k", "--disable", "a.qcow2", "b1 ä"))},
		{"bitmap in use", qemuCreate("-f qcow2 -o cluster_size=4k a.qcow2 64M",
			run("qemu-img", "bitmap", "--add", "a.qcow2", "b0"),
			func(t *testing.T, dir string) {
				// qemu-io killed with the bitmap loaded leaves it in use.
				testutil.QemuIOExit(t, filepath.Join(dir, "a.qcow2"), "qcow2", "write 0 64k", "sigraise 9")
			})},
		{"raw", qemuCreate("-f raw a.raw 10M")},
		{"raw odd size", func(t *testing.T, dir string) string {
			if err := os.WriteFile(filepath.Join(dir, "a.raw"), []byte("not a sector"), 0o644); err != nil {
				t.Fatal(err)
			}
			return "a.raw"
		}},
		{"name with comma", qemuCreate("-f qcow2 a,b.qcow2 1M")},

		{"ovis v3", ovisCreate("-f qcow2 a.qcow2 1G")},
		{"ovis v2", ovisCreate("-f qcow2 -o compat=0.10 a.qcow2 1G")},
		{"ovis small clusters", ovisCreate("-f qcow2 -o cluster_size=4k,refcount_bits=8,lazy_refcounts=on a.qcow2 1.5G")},
		{"ovis extended l2 zstd", ovisCreate("-f qcow2 -o extended_l2=on,compression_type=zstd a.qcow2 100M")},
		{"ovis data file raw", ovisCreate("-f qcow2 -o data_file=a.data,data_file_raw=on a.qcow2 10M")},
		{"ovis prealloc full", ovisCreate("-f qcow2 -o preallocation=full a.qcow2 4M")},
		{"ovis backing", after(ovisCreate("-f qcow2 -b base.raw -F raw a.qcow2"),
			run("qemu-img", "create", "-q", "-f", "raw", "base.raw", "64M"))},
		{"ovis snapshots", ovisCreate("-f qcow2 a.qcow2 64M",
			run("qemu-img", "snapshot", "-c", "snap1", "a.qcow2"))},
		{"ovis raw", ovisCreate("-f raw a.raw 10M")},
	}
	return v
}

// actualSizeRE matches the lines that report allocation, which depend on
// when each tool looked.
var actualSizeRE = regexp.MustCompile(`(?m)^\s*"actual-size": \d+,\n|^disk size: .*\n`)

// TestInfoMatchesQemu compares ovis img info with qemu-img info on many
// images, as text (every byte but the allocation lines) and field by field,
// in both output formats, with and without --backing-chain, with and
// without -f.
func TestInfoMatchesQemu(t *testing.T) {
	for _, v := range infoVariants() {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			name := v.build(t, dir)
			for _, extra := range [][]string{nil, {"--backing-chain"}, {"-U"}} {
				for _, out := range []string{"human", "json"} {
					args := append([]string{"info", "--output=" + out}, extra...)
					args = append(args, name)
					q := qemuImg(t, dir, args...)
					o := ovisImg(t, dir, args...)
					what := strings.Join(args, " ")
					q.stdout = actualSizeRE.ReplaceAllString(q.stdout, "")
					o.stdout = actualSizeRE.ReplaceAllString(o.stdout, "")
					sameResult(t, what, q, o)
					if out == "json" && q.code == 0 && o.code == 0 {
						sameJSONFields(t, what, q.stdout, o.stdout)
					}
				}
			}
		})
	}
}

// sameJSONFields decodes both outputs and reports every field that differs
// by its path, so that a failure names the field rather than a line.
func sameJSONFields(t *testing.T, what, q, o string) {
	t.Helper()
	var qv, ov any
	if err := json.Unmarshal([]byte(q), &qv); err != nil {
		t.Fatalf("%s: qemu-img JSON: %v", what, err)
	}
	if err := json.Unmarshal([]byte(o), &ov); err != nil {
		t.Fatalf("%s: ovis JSON: %v\n%s", what, err, o)
	}
	var diffs []string
	diffJSON("", qv, ov, &diffs)
	sort.Strings(diffs)
	for _, d := range diffs {
		t.Errorf("%s: %s", what, d)
	}
}

func diffJSON(path string, q, o any, diffs *[]string) {
	switch qv := q.(type) {
	case map[string]any:
		ov, ok := o.(map[string]any)
		if !ok {
			*diffs = append(*diffs, path+": ovis has "+jsonString(o)+", qemu-img an object")
			return
		}
		for k, v := range qv {
			if w, ok := ov[k]; ok {
				diffJSON(path+"/"+k, v, w, diffs)
			} else {
				*diffs = append(*diffs, path+"/"+k+": missing in ovis (qemu-img: "+jsonString(v)+")")
			}
		}
		for k, w := range ov {
			if _, ok := qv[k]; !ok {
				*diffs = append(*diffs, path+"/"+k+": only in ovis ("+jsonString(w)+")")
			}
		}
	case []any:
		ov, ok := o.([]any)
		if !ok || len(ov) != len(qv) {
			*diffs = append(*diffs, path+": ovis has "+jsonString(o)+", qemu-img "+jsonString(q))
			return
		}
		for i := range qv {
			diffJSON(path+"/"+strings.Repeat("#", 1)+jsonString(i), qv[i], ov[i], diffs)
		}
	default:
		if !reflect.DeepEqual(q, o) {
			*diffs = append(*diffs, path+": ovis has "+jsonString(o)+", qemu-img "+jsonString(q))
		}
	}
}

func jsonString(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// infoRefusedDamage is the check variants' damage that qemu-img 7.2 info
// refuses: qcow2_open validates the snapshot count, the snapshot table's
// offset and each entry's extra data, but none of the L1 or refcount
// table entries, nor the snapshots' L1 tables, and it reads a table
// running past the end of the file as zeros. Keys omit the " v2" suffix.
var infoRefusedDamage = map[string]bool{
	"too many snapshots":                true,
	"snapshot table misaligned":         true,
	"snapshot with too much extra data": true,
}

// ioRefusedDamage is damage that info describes but a normal open, for
// reading or writing, must still refuse.
var ioRefusedDamage = map[string]bool{
	"refcount table entry misaligned":         true,
	"L1 entry misaligned":                     true,
	"L1 entry past the end of the file":       true,
	"snapshot L1 table misaligned":            true,
	"snapshot L1 table too large":             true,
	"snapshot table past the end of the file": true,
}

// TestInfoDamagedMatchesQemu runs info on every clean and damaged image
// of TestCheckMatchesQemu: ovis must describe those qemu-img describes,
// field by field, and refuse the others with qemu-img's message and exit
// code, while a normal open (convert) still refuses what it cannot read.
func TestInfoDamagedMatchesQemu(t *testing.T) {
	for _, v := range checkVariants() {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			v.build(t, dir)
			damage := strings.TrimSuffix(v.name, " v2")
			for _, extra := range [][]string{nil, {"-f", "qcow2"}, {"--backing-chain"}} {
				for _, out := range []string{"json", "human"} {
					args := append(append([]string{"info", "--output=" + out}, extra...), "a.qcow2")
					what := strings.Join(args, " ")
					q, o := qemuImg(t, dir, args...), ovisImg(t, dir, args...)
					if refused := q.code != 0; refused != infoRefusedDamage[damage] {
						t.Errorf("qemu-img %s: exit %d, expected refused=%v\n%s", what, q.code, infoRefusedDamage[damage], q.stderr)
					}
					q.stdout = actualSizeRE.ReplaceAllString(q.stdout, "")
					o.stdout = actualSizeRE.ReplaceAllString(o.stdout, "")
					sameResult(t, what, q, o)
					if out == "json" && q.code == 0 && o.code == 0 {
						sameJSONFields(t, what, q.stdout, o.stdout)
					}
				}
			}
			if ioRefusedDamage[damage] {
				o := ovisImg(t, dir, "convert", "-O", "raw", "a.qcow2", "b.raw")
				if o.code != 1 || !strings.Contains(o.stderr, "corrupt image") {
					t.Errorf("ovis img convert: exit %d, want 1 and a corrupt image\n%s", o.code, o.stderr)
				}
			}
		})
	}
}
