// Package layering holds the test that keeps the module's dependency
// arrows pointing the way docs/architecture.md draws them.
package layering

import (
	"encoding/json"
	"io"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/ovis-storage/ovis"

// pkg is what go list says of one package.
type pkg struct {
	ImportPath string
	Imports    []string // direct imports
	Deps       []string // every package it depends on, transitively
}

// listPackages runs go list over the module.
func listPackages(t *testing.T) []pkg {
	t.Helper()
	cmd := exec.Command("go", "list", "-json", "./...")
	cmd.Dir = "../.."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	var pkgs []pkg
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p pkg
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatalf("go list output: %v", err)
		}
		pkgs = append(pkgs, p)
	}
	if len(pkgs) < 4 {
		t.Fatalf("go list found %d packages; the module has more", len(pkgs))
	}
	return pkgs
}

// networkPackages are the standard library's ways onto the network.
var networkPackages = []string{"net", "net/http", "net/rpc", "crypto/tls", "net/netip"}

// TestImportDirection fails on an arrow that points the wrong way.
func TestImportDirection(t *testing.T) {
	ours := func(p string) bool { return p == module || strings.HasPrefix(p, module+"/") }
	rel := func(p string) string { return strings.TrimPrefix(strings.TrimPrefix(p, module), "/") }
	under := func(p, dir string) bool { r := rel(p); return r == dir || strings.HasPrefix(r, dir+"/") }

	rules := []struct {
		name string
		// applies says whether the rule is about package p.
		applies func(p string) bool
		// forbidden says whether p may not depend on dep (transitively
		// for ovis packages, directly for the standard library).
		forbidden func(p, dep string, direct bool) bool
	}{
		{"block imports no ovis package",
			func(p string) bool { return under(p, "block") },
			func(p, dep string, direct bool) bool { return ours(dep) }},
		{"qcow2 imports neither nbd, image, convert, the cluster nor the network",
			func(p string) bool { return under(p, "qcow2") },
			func(p, dep string, direct bool) bool {
				return ours(dep) && (under(dep, "nbd") || under(dep, "image") || under(dep, "convert") || under(dep, "cluster")) ||
					direct && slices.Contains(networkPackages, dep)
			}},
		{"nbd imports neither qcow2, image, convert nor the cluster",
			func(p string) bool { return under(p, "nbd") },
			func(p, dep string, direct bool) bool {
				return ours(dep) && (under(dep, "qcow2") || under(dep, "image") || under(dep, "convert") || under(dep, "cluster"))
			}},
		{"image imports neither nbd, convert nor the cluster",
			func(p string) bool { return under(p, "image") },
			func(p, dep string, direct bool) bool {
				return ours(dep) && (under(dep, "nbd") || under(dep, "convert") || under(dep, "cluster"))
			}},
		{"convert imports neither nbd nor the cluster",
			func(p string) bool { return under(p, "convert") },
			func(p, dep string, direct bool) bool {
				return ours(dep) && (under(dep, "nbd") || under(dep, "cluster"))
			}},
		{"export, the middleware over any device, imports neither qcow2 nor the cluster",
			func(p string) bool { return under(p, "export") },
			func(p, dep string, direct bool) bool {
				return ours(dep) && (under(dep, "qcow2") || under(dep, "cluster"))
			}},
		{"cluster/membership, the only etcd client, imports neither the store, the gateway nor nbd",
			func(p string) bool { return under(p, "cluster/membership") },
			func(p, dep string, direct bool) bool {
				return ours(dep) && (under(dep, "cluster/store") || under(dep, "cluster/gateway") || under(dep, "nbd"))
			}},
		{"cluster/object and cluster/placement are pure: the standard library's non-I/O packages and object only",
			func(p string) bool { return under(p, "cluster/placement") || under(p, "cluster/object") },
			func(p, dep string, direct bool) bool {
				return ours(dep) && !under(dep, "cluster/object") ||
					direct && (slices.Contains(networkPackages, dep) || dep == "os" || dep == "time" || dep == "math/rand" || dep == "math/rand/v2" || dep == "crypto/rand" || dep == "syscall")
			}},
		{"cluster/recovery is pure: no ovis package, no I/O, no clock",
			func(p string) bool { return under(p, "cluster/recovery") },
			func(p, dep string, direct bool) bool {
				return ours(dep) ||
					direct && (slices.Contains(networkPackages, dep) || dep == "os" || dep == "time" || dep == "math/rand" || dep == "math/rand/v2" || dep == "crypto/rand" || dep == "syscall")
			}},
		{"cluster/protocol, the wire format, imports no ovis package but cluster/object, and not etcd",
			func(p string) bool { return under(p, "cluster/protocol") },
			func(p, dep string, direct bool) bool {
				return ours(dep) && !under(dep, "cluster/object") || strings.HasPrefix(dep, "go.etcd.io/")
			}},
		{"cluster/store, one node's disk, imports no network, no etcd and no cluster package but object (and its own vfs)",
			func(p string) bool { return under(p, "cluster/store") },
			func(p, dep string, direct bool) bool {
				return ours(dep) && !under(dep, "cluster/object") && !under(dep, "cluster/store") || strings.HasPrefix(dep, "go.etcd.io/") ||
					direct && slices.Contains(networkPackages, dep)
			}},
		{"cluster/gateway, a VDI as a device, imports neither etcd, membership, the store nor nbd",
			func(p string) bool { return under(p, "cluster/gateway") },
			func(p, dep string, direct bool) bool {
				return ours(dep) && (under(dep, "cluster/membership") || under(dep, "cluster/store") || under(dep, "cluster/node") || under(dep, "nbd")) ||
					strings.HasPrefix(dep, "go.etcd.io/")
			}},
		{"cluster/admin, the admin plane's declarations, imports neither the node that serves it, the gateway, the store nor nbd",
			func(p string) bool { return under(p, "cluster/admin") },
			func(p, dep string, direct bool) bool {
				return ours(dep) && (under(dep, "cluster/node") || under(dep, "cluster/gateway") || under(dep, "cluster/store") || under(dep, "nbd"))
			}},
		{"nothing outside cmd imports cmd",
			func(p string) bool { return !under(p, "cmd") },
			func(p, dep string, direct bool) bool { return ours(dep) && under(dep, "cmd") }},
	}
	pkgs := listPackages(t)
	for _, r := range rules {
		checked := 0
		for _, p := range pkgs {
			if !ours(p.ImportPath) || !r.applies(p.ImportPath) {
				continue
			}
			checked++
			for _, dep := range p.Deps {
				direct := slices.Contains(p.Imports, dep)
				if r.forbidden(p.ImportPath, dep, direct) {
					t.Errorf("%s: %s depends on %s", r.name, rel(p.ImportPath), dep)
				}
			}
		}
		if checked == 0 {
			t.Errorf("%s: no package of the module is subject to it; the rule is stale", r.name)
		}
	}
}
