package qcow2

import (
	"bytes"
	"math/rand"
	"path/filepath"
	"strings"
	"testing"
)

// TestAmend walks an image through compat and refcount-width changes; after
// each step qemu-img check is clean, qemu-img info shows the new options
// and the contents are unchanged.
func TestAmend(t *testing.T) {
	for _, backing := range []bool{false, true} {
		name := "nobacking"
		if backing {
			name = "backing"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			p := filepath.Join(dir, "a.qcow2")
			if backing {
				b := filepath.Join(dir, "b.qcow2")
				runQemu(t, "qemu-img", "create", "-f", "qcow2", b, "8M")
				runQemu(t, "qemu-io", "-c", "write -P 4 0 8M", b)
				runQemu(t, "qemu-img", "create", "-f", "qcow2", "-b", "b.qcow2", "-F", "qcow2", p)
			} else {
				runQemu(t, "qemu-img", "create", "-f", "qcow2", p, "8M")
			}
			runQemu(t, "qemu-io", "-c", "write -P 1 0 2M", "-c", "write -z 1M 128k", "-c", "write -z 4M 64k", p)
			// A preallocated zero cluster too.
			runQemu(t, "qemu-io", "-c", "write -P 2 6M 64k", "-c", "write -z 6M 64k", p)
			img, err := Open(p, Options{})
			if err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewSource(5))
			randomWrites(t, img, rng, 10)
			want := readAll(t, img)
			steps := []struct {
				o    AmendOptions
				info string
			}{
				{AmendOptions{RefcountBits: 64}, "refcount bits: 64"},
				{AmendOptions{RefcountBits: 1}, "refcount bits: 1"},
				{AmendOptions{RefcountBits: 16}, "refcount bits: 16"},
				{AmendOptions{Compat: "0.10"}, "compat: 0.10"},
				{AmendOptions{Compat: "1.1"}, "compat: 1.1"},
				{AmendOptions{LazyRefcounts: ptr(true)}, "lazy refcounts: true"},
				{AmendOptions{LazyRefcounts: ptr(false)}, "lazy refcounts: false"},
			}
			for _, st := range steps {
				if err := img.Amend(st.o); err != nil {
					t.Fatalf("amend %+v: %v", st.o, err)
				}
				if !bytes.Equal(readAll(t, img), want) {
					t.Fatalf("amend %+v changed the contents", st.o)
				}
				if err := img.Close(); err != nil {
					t.Fatal(err)
				}
				qemuCheck(t, p)
				if info := runQemu(t, "qemu-img", "info", p); !strings.Contains(info, st.info) {
					t.Fatalf("after amend %+v, qemu-img info lacks %q:\n%s", st.o, st.info, info)
				}
				if img, err = Open(p, Options{}); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(readAll(t, img), want) {
					t.Fatalf("after amend %+v and reopen the contents differ", st.o)
				}
			}
			if err := img.Amend(AmendOptions{RefcountBits: 8, Compat: "0.10"}); err == nil {
				t.Fatal("downgrade with 8-bit refcounts succeeded")
			}
			img.Close()
		})
	}
}

func TestSetBacking(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "t.qcow2")
	runQemu(t, "qemu-img", "create", "-f", "raw", filepath.Join(dir, "b.raw"), "1M")
	runQemu(t, "qemu-img", "create", "-f", "qcow2", p, "1M")
	img, err := Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := img.SetBacking("b.raw", "raw"); err != nil {
		t.Fatal(err)
	}
	img.Close()
	if info := runQemu(t, "qemu-img", "info", p); !strings.Contains(info, "backing file: b.raw") || !strings.Contains(info, "backing file format: raw") {
		t.Fatalf("qemu-img info:\n%s", info)
	}
	qemuCheck(t, p)
}
