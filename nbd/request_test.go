package nbd

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"testing"
)

var errnoNames = map[string]Errno{
	"ok": 0, "EPERM": EPERM, "EIO": EIO, "ENOMEM": ENOMEM, "EINVAL": EINVAL,
	"ENOSPC": ENOSPC, "EOVERFLOW": EOVERFLOW, "ENOTSUP": ENOTSUP, "ESHUTDOWN": ESHUTDOWN,
}

var flagNames = map[string]cmdFlags{
	"FUA": cmdFlagFUA, "NO_HOLE": cmdFlagNoHole, "DF": cmdFlagDF,
	"REQ_ONE": cmdFlagReqOne, "FAST_ZERO": cmdFlagFastZero,
}

// TestValidateTable runs testdata/validate.txt through validate.
func TestValidateTable(t *testing.T) {
	t.Parallel()
	f, err := os.Open("testdata/validate.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmdNames := map[string]cmdType{}
	for i, c := range commands {
		if c.name != "" {
			cmdNames[c.name] = cmdType(i)
		}
	}
	var sess session
	sc := bufio.NewScanner(f)
	for line := 1; sc.Scan(); line++ {
		text := strings.TrimSpace(sc.Text())
		if text == "" || strings.HasPrefix(text, "#") {
			continue
		}
		fields := strings.Fields(text)
		if fields[0] == "export" {
			kv := map[string]string{}
			for _, f := range fields[1:] {
				k, v, _ := strings.Cut(f, "=")
				kv[k] = v
			}
			size, _ := strconv.ParseUint(kv["size"], 10, 64)
			contexts, _ := strconv.Atoi(kv["contexts"])
			e := &Export{ReadOnly: kv["readonly"] == "true", NoFUA: kv["nofua"] == "true"}
			sess = session{size: size, flags: exportFlags(e, kv["structured"] == "true"), maxPayload: DefaultMaxPayload, contexts: contexts}
			continue
		}
		if len(fields) != 6 || fields[4] != "->" {
			t.Fatalf("line %d: malformed %q", line, text)
		}
		var r request
		if c, ok := cmdNames[fields[0]]; ok {
			r.typ = c
		} else {
			n, err := strconv.ParseUint(fields[0], 0, 16)
			if err != nil {
				t.Fatalf("line %d: command %q", line, fields[0])
			}
			r.typ = cmdType(n)
		}
		if fields[1] != "-" {
			for _, name := range strings.Split(fields[1], ",") {
				if f, ok := flagNames[name]; ok {
					r.flags |= f
					continue
				}
				n, err := strconv.ParseUint(name, 0, 16)
				if err != nil {
					t.Fatalf("line %d: flag %q", line, name)
				}
				r.flags |= cmdFlags(n)
			}
		}
		var err1, err2 error
		r.offset, err1 = strconv.ParseUint(fields[2], 10, 64)
		length, err2 := strconv.ParseUint(fields[3], 10, 32)
		if err1 != nil || err2 != nil {
			t.Fatalf("line %d: numbers: %v %v", line, err1, err2)
		}
		r.length = uint32(length)
		want, ok := errnoNames[fields[5]]
		if !ok {
			t.Fatalf("line %d: result %q", line, fields[5])
		}
		if got := validate(r, sess); got != want {
			t.Errorf("line %d: %s: got %v, want %v", line, text, got, want)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
}

// TestPayloadOnlyForWrite: no command but WRITE has bytes after its
// header, whatever its length field says.
func TestPayloadOnlyForWrite(t *testing.T) {
	t.Parallel()
	for c := 0; c < 1<<16; c++ {
		r := request{typ: cmdType(c), length: 4096}
		if got := payloadLen(r); (got != 0) != (cmdType(c) == cmdWrite) {
			t.Fatalf("payloadLen(%v) = %d", cmdType(c), got)
		}
	}
}
