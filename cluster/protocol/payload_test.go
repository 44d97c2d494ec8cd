package protocol

import (
	"errors"
	"slices"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
	"pgregory.net/rapid"
)

func TestObjectInfosRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		ids := rapid.SliceOfNDistinct(rapid.Uint64(), 0, 50, rapid.ID[uint64]).Draw(t, "ids")
		slices.Sort(ids)
		infos := make([]ObjectInfo, len(ids))
		for i, id := range ids {
			infos[i] = ObjectInfo{ID: object.ID(id), Version: rapid.Uint64().Draw(t, "v"),
				Allocated: rapid.Int64Range(0, MaxObjectSpan).Draw(t, "alloc")}
		}
		p := AppendObjectInfos(nil, infos)
		if len(p) != len(infos)*ObjectInfoLen {
			t.Fatalf("%d bytes for %d infos", len(p), len(infos))
		}
		prefix := []ObjectInfo{{ID: 1}}
		got, err := ParseObjectInfos(prefix, p)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got[1:], infos) || got[0] != prefix[0] {
			t.Fatalf("got %v, want %v", got, infos)
		}
	})
}

func TestExtentsRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		off := rapid.Uint64Range(0, MaxObjectSpan-1).Draw(t, "start")
		var exts []Extent
		for range rapid.IntRange(0, 30).Draw(t, "n") {
			if off >= MaxObjectSpan {
				break
			}
			l := rapid.Uint64Range(1, MaxObjectSpan-off).Draw(t, "len")
			exts = append(exts, Extent{Offset: off, Length: l, Hole: rapid.Bool().Draw(t, "hole")})
			off += l
		}
		got, err := ParseExtents(nil, AppendExtents(nil, exts))
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, exts) {
			t.Fatalf("got %v, want %v", got, exts)
		}
	})
}

func TestParseRefuses(t *testing.T) {
	info := func(id uint64, alloc int64) []byte {
		return AppendObjectInfos(nil, []ObjectInfo{{ID: object.ID(id), Allocated: alloc}})
	}
	ext := func(off, l uint64, hole bool) []byte { return AppendExtents(nil, []Extent{{off, l, hole}}) }
	tests := []struct {
		name  string
		parse func() error
	}{
		{"infos partial", func() error { _, err := ParseObjectInfos(nil, make([]byte, 25)); return err }},
		{"infos negative", func() error { _, err := ParseObjectInfos(nil, info(1, -1)); return err }},
		{"infos too large", func() error { _, err := ParseObjectInfos(nil, info(1, MaxObjectSpan+1)); return err }},
		{"infos unsorted", func() error { _, err := ParseObjectInfos(nil, append(info(2, 0), info(1, 0)...)); return err }},
		{"infos duplicate", func() error { _, err := ParseObjectInfos(nil, append(info(2, 0), info(2, 0)...)); return err }},
		{"extents partial", func() error { _, err := ParseExtents(nil, make([]byte, 19)); return err }},
		{"extent empty", func() error { _, err := ParseExtents(nil, ext(0, 0, false)); return err }},
		{"extent past object", func() error { _, err := ParseExtents(nil, ext(MaxObjectSpan-1, 2, false)); return err }},
		{"extent overflow", func() error { _, err := ParseExtents(nil, ext(1<<63, 1<<63, false)); return err }},
		{"extents gap", func() error { _, err := ParseExtents(nil, append(ext(0, 1, false), ext(2, 1, true)...)); return err }},
		{"extent flags", func() error {
			p := ext(0, 1, false)
			p[19] = 2
			_, err := ParseExtents(nil, p)
			return err
		}},
		{"checksum short", func() error { _, _, err := ParseChecksumReply(make([]byte, 11)); return err }},
	}
	for _, tt := range tests {
		if err := tt.parse(); !errors.Is(err, ErrPayload) {
			t.Errorf("%s: %v, want ErrPayload", tt.name, err)
		}
	}
	crc, v, err := ParseChecksumReply(AppendChecksumReply(nil, 0xdeadbeef, 42))
	if err != nil || crc != 0xdeadbeef || v != 42 {
		t.Fatalf("checksum reply: %#x %d %v", crc, v, err)
	}
}
