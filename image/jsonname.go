package image

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
)

// The causes of a JSONError besides the decoder's own errors.
var (
	// ErrJSONNotObject: the value is not an object.
	ErrJSONNotObject = errors.New("not a JSON object")
	// ErrJSONTrailing: more follows the object.
	ErrJSONTrailing = errors.New("more than one JSON value")
)

// JSONError is the error of FlattenJSON.
type JSONError struct {
	// Input is the text given, Offset how far the decoder read into it.
	Input  string
	Offset int64
	// Err is ErrJSONNotObject, ErrJSONTrailing or encoding/json's error
	// (a *json.SyntaxError, io.EOF or io.ErrUnexpectedEOF for a text
	// that ends early).
	Err error
}

func (e *JSONError) Error() string {
	return fmt.Sprintf("image: json: name at byte %d: %v", e.Offset, e.Err)
}

func (e *JSONError) Unwrap() error { return e.Err }

// FlattenJSON turns the object of a json: name (the text after "json:")
// into an option list for ParseOpts, as QEMU flattens it: nested objects
// become dotted names ("file.filename"), list items numbered ones, true
// and false on and off, null members are dropped, commas in values are
// doubled, and the keys keep their order. A top-level file driver
// ({"driver": "file", "filename": ...}) is read as the raw format over
// the file, which fileProtocol reports. The error is a *JSONError.
func FlattenJSON(s string) (list string, fileProtocol bool, err error) {
	fail := func(at int64, err error) (string, bool, error) {
		return "", false, &JSONError{Input: s, Offset: at, Err: err}
	}
	dec := json.NewDecoder(strings.NewReader(s))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil {
		return fail(dec.InputOffset(), err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return fail(dec.InputOffset(), ErrJSONNotObject)
	}
	var parts []string
	if err := flattenJSON(dec, "", '}', &parts); err != nil {
		return fail(dec.InputOffset(), err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return fail(dec.InputOffset(), ErrJSONTrailing)
	}
	// The file protocol alone: ovis reads it as a raw image.
	for i, p := range parts {
		if p == "driver=file" {
			fileProtocol = true
			parts[i] = "driver=raw"
			for j, q := range parts {
				if j != i && !strings.HasPrefix(q, "file.") && !strings.HasPrefix(q, "driver=") {
					parts[j] = "file." + q
				}
			}
			break
		}
	}
	return strings.Join(parts, ","), fileProtocol, nil
}

// flattenJSON appends the members of the object (end '}') or the items of
// the list (end ']') dec is inside of to parts, named after prefix.
func flattenJSON(dec *json.Decoder, prefix string, end json.Delim, parts *[]string) error {
	for i := 0; dec.More(); i++ {
		name := fmt.Sprintf("%s%d", prefix, i)
		if end == '}' {
			k, err := dec.Token()
			if err != nil {
				return err
			}
			name = prefix + k.(string)
		}
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		var v string
		switch t := tok.(type) {
		case json.Delim:
			close := json.Delim('}')
			if t == '[' {
				close = ']'
			}
			if err := flattenJSON(dec, name+".", close, parts); err != nil {
				return err
			}
			continue
		case string:
			v = t
		case json.Number:
			v = t.String()
		case bool:
			v = "off"
			if t {
				v = "on"
			}
		case nil:
			continue // QEMU drops null members
		}
		*parts = append(*parts, name+"="+strings.ReplaceAll(v, ",", ",,"))
	}
	_, err := dec.Token() // the closing delimiter
	return err
}
