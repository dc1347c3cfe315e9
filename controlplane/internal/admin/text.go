package admin

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// checkText walks every string of a request message (fields, repeated
// elements, map keys and values, nested messages) and refuses NUL
// characters and invalid UTF-8 with InvalidArgument naming each field by
// its path ("key.metadata[\"env\"]", "tags[2]"). Postgres text and jsonb
// cannot hold NUL and every column is UTF-8, so without this check such a
// value would reach the database and come back as an internal error. The
// codecs already refuse invalid UTF-8 in proto3 strings; checking it here
// as well keeps the rule in one place whatever the codec.
//
// Bytes fields are not text and are not checked.
func checkText(m proto.Message) error {
	c := &validator{}
	walkText(c, "", m.ProtoReflect(), checkString)
	return c.err()
}

// walkText calls check with the path and value of every string of m.
func walkText(c *validator, prefix string, m protoreflect.Message, check func(c *validator, path, s string)) {
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		path := string(fd.Name())
		if prefix != "" {
			path = prefix + "." + path
		}
		switch {
		case fd.IsMap():
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				if fd.MapKey().Kind() == protoreflect.StringKind {
					check(c, path+"[key "+strconv.Quote(printable(k.String()))+"]", k.String())
				}
				elem := path + "[" + strconv.Quote(printable(k.String())) + "]"
				checkValue(c, elem, fd.MapValue(), mv, check)
				return true
			})
		case fd.IsList():
			l := v.List()
			for i := 0; i < l.Len(); i++ {
				checkValue(c, fmt.Sprintf("%s[%d]", path, i), fd, l.Get(i), check)
			}
		default:
			checkValue(c, path, fd, v, check)
		}
		return true
	})
}

func checkValue(c *validator, path string, fd protoreflect.FieldDescriptor, v protoreflect.Value, check func(c *validator, path, s string)) {
	switch fd.Kind() {
	case protoreflect.StringKind:
		check(c, path, v.String())
	case protoreflect.MessageKind, protoreflect.GroupKind:
		walkText(c, path, v.Message(), check)
	}
}

func checkString(c *validator, path, s string) {
	switch {
	case !utf8.ValidString(s):
		c.add(path, "must be valid UTF-8")
	case strings.IndexByte(s, 0) >= 0:
		c.add(path, "must not contain NUL (\\u0000) characters")
	}
}

// printable shortens a map key for an error message (strconv.Quote then
// escapes what is not printable).
func printable(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

// The codecs below decode exactly like Connect's default "proto" and
// "json" codecs (same options); they differ only when a message fails to
// decode because of invalid UTF-8 in a string, which the protobuf
// libraries report without naming the field: they find the field(s) and
// answer a ValidationError naming each by its path, like checkText.

// textProtoCodec is the binary protobuf codec.
type textProtoCodec struct{}

func (textProtoCodec) Name() string { return "proto" }

func (textProtoCodec) Marshal(m any) ([]byte, error) {
	pm, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("%T is not a proto.Message", m)
	}
	return proto.Marshal(pm)
}

func (textProtoCodec) Unmarshal(data []byte, m any) error {
	pm, ok := m.(proto.Message)
	if !ok {
		return fmt.Errorf("%T is not a proto.Message", m)
	}
	if err := proto.Unmarshal(data, pm); err != nil {
		c := &validator{}
		invalidUTF8Wire(c, pm.ProtoReflect().Descriptor(), data, "", 0)
		if verr := c.err(); verr != nil {
			return verr
		}
		return fmt.Errorf("unmarshal into %T: %w", m, err)
	}
	return checkUnknown(pm)
}

// invalidUTF8Wire walks protobuf wire data of a message of type md and
// records each string field holding invalid UTF-8. It stops quietly at
// malformed data (the decoder's own error is answered then).
func invalidUTF8Wire(c *validator, md protoreflect.MessageDescriptor, b []byte, prefix string, depth int) {
	if depth > 32 {
		return
	}
	seen := map[protowire.Number]int{}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return
		}
		b = b[n:]
		fd := md.Fields().ByNumber(num)
		if fd == nil || typ != protowire.BytesType {
			if n = protowire.ConsumeFieldValue(num, typ, b); n < 0 {
				return
			}
			b = b[n:]
			continue
		}
		v, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return
		}
		b = b[n:]
		path := string(fd.Name())
		if prefix != "" {
			path = prefix + "." + path
		}
		if fd.IsList() {
			path = fmt.Sprintf("%s[%d]", path, seen[num])
			seen[num]++
		}
		switch {
		case fd.IsMap():
			mapEntryUTF8(c, fd, v, path, depth)
		case fd.Kind() == protoreflect.StringKind:
			if !utf8.Valid(v) {
				c.add(path, "must be valid UTF-8")
			}
		case fd.Kind() == protoreflect.MessageKind:
			invalidUTF8Wire(c, fd.Message(), v, path, depth+1)
		}
	}
}

// mapEntryUTF8 checks one map entry (key = field 1, value = field 2).
func mapEntryUTF8(c *validator, fd protoreflect.FieldDescriptor, b []byte, path string, depth int) {
	var key, val []byte
	var haveVal bool
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return
		}
		b = b[n:]
		if typ != protowire.BytesType {
			if n = protowire.ConsumeFieldValue(num, typ, b); n < 0 {
				return
			}
			b = b[n:]
			continue
		}
		v, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return
		}
		b = b[n:]
		switch num {
		case 1:
			key = v
		case 2:
			val, haveVal = v, true
		}
	}
	k := "…"
	if fd.MapKey().Kind() == protoreflect.StringKind {
		k = string(key)
		if !utf8.Valid(key) {
			c.add(path+"[key "+strconv.Quote(printable(k))+"]", "must be valid UTF-8")
		}
	}
	elem := path + "[" + strconv.Quote(printable(k)) + "]"
	switch {
	case !haveVal:
	case fd.MapValue().Kind() == protoreflect.StringKind:
		if !utf8.Valid(val) {
			c.add(elem, "must be valid UTF-8")
		}
	case fd.MapValue().Kind() == protoreflect.MessageKind:
		invalidUTF8Wire(c, fd.MapValue().Message(), val, elem, depth+1)
	}
}

// textJSONCodec is the Connect JSON codec (name "json" or
// "json; charset=utf-8").
type textJSONCodec struct{ name string }

func (c textJSONCodec) Name() string { return c.name }

func (textJSONCodec) Marshal(m any) ([]byte, error) {
	pm, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("%T is not a proto.Message", m)
	}
	return protojson.MarshalOptions{}.Marshal(pm)
}

// utf8Marker (a JSON escape) stands in for invalid bytes while the
// fields holding them are looked for; it decodes to markerRune, a
// noncharacter. Should the request hold that rune elsewhere too, that
// field is named as well: the request is refused either way.
const (
	utf8Marker = `\uFDD0`
	markerRune = "\uFDD0"
)

func (textJSONCodec) Unmarshal(data []byte, m any) error {
	pm, ok := m.(proto.Message)
	if !ok {
		return fmt.Errorf("%T is not a proto.Message", m)
	}
	if len(data) == 0 {
		return errors.New("zero-length payload is not a valid JSON object")
	}
	data, err := strictJSON(pm.ProtoReflect().Descriptor(), data)
	if err != nil {
		return err
	}
	// Unknown fields are errors (strictJSON named them; this is the
	// backstop for anything it could not parse).
	opts := protojson.UnmarshalOptions{DiscardUnknown: false}
	err = opts.Unmarshal(data, pm)
	if err == nil {
		return nil
	}
	if !utf8.Valid(data) {
		// Decode again with each invalid sequence replaced by the marker,
		// then name the strings that hold it. Invalid bytes outside a
		// string value leave the decoder's own error.
		probe := pm.ProtoReflect().New()
		if opts.Unmarshal(bytes.ToValidUTF8(data, []byte(utf8Marker)), probe.Interface()) == nil {
			c := &validator{}
			walkText(c, "", probe, func(c *validator, path, s string) {
				if strings.Contains(s, markerRune) {
					// A map key in the path shows the marker as \ufdd0.
					c.add(strings.ReplaceAll(path, `\ufdd0`, "\uFFFD"), "must be valid UTF-8")
				}
			})
			if verr := c.err(); verr != nil {
				return verr
			}
		}
	}
	return fmt.Errorf("unmarshal into %T: %w", m, err)
}
