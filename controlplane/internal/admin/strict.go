package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Strict input: the admin API refuses what it does not understand. A
// field the schema does not have (a misspelling, a field of a newer or
// older client) is InvalidArgument naming the field, in Connect JSON and
// in binary protobuf alike: a setting that would be silently dropped is
// refused instead (a team created without the limit its caller meant to
// set is worse than an error).
//
// JSON names fields; binary protobuf only numbers them, so an unknown
// binary field is named by its path and number ("org.limits: unknown
// field number 99").

const fieldMaskName = "google.protobuf.FieldMask"

// strictJSON checks a Connect JSON request against md before it is
// decoded: every object key must be a field (by its JSON or its proto
// name) of the message at that place; unknown ones are reported by
// path. It also rewrites update-mask paths given with proto names
// ("limits.rpm_limit", which protojson refuses) to JSON names
// ("limits.rpmLimit"), so either spelling works over JSON as over
// binary. Data the JSON decoder cannot parse is returned unchanged for
// protojson to report.
func strictJSON(md protoreflect.MessageDescriptor, data []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return data, nil
	}
	c := &validator{}
	changed := walkJSON(c, md, "", v)
	if err := c.err(); err != nil {
		return nil, err
	}
	if !changed {
		return data, nil
	}
	out, err := json.Marshal(v)
	if err != nil {
		return data, nil
	}
	return out, nil
}

// walkJSON checks the JSON object v against md and reports whether it
// rewrote a field mask in place.
func walkJSON(c *validator, md protoreflect.MessageDescriptor, prefix string, v any) bool {
	obj, ok := v.(map[string]any)
	if !ok || strings.HasPrefix(string(md.FullName()), "google.protobuf.") {
		return false // not an object (protojson reports it), or a well-known type with its own JSON form
	}
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	changed := false
	for _, k := range keys {
		path := k
		if prefix != "" {
			path = prefix + "." + k
		}
		fd := md.Fields().ByJSONName(k)
		if fd == nil {
			fd = md.Fields().ByTextName(k)
		}
		if fd == nil {
			c.add(path, "unknown field (not a field of %s)", md.Name())
			continue
		}
		val := obj[k]
		switch {
		case fd.IsMap():
			m, _ := val.(map[string]any)
			if fd.MapValue().Kind() != protoreflect.MessageKind {
				continue
			}
			mk := make([]string, 0, len(m))
			for k := range m {
				mk = append(mk, k)
			}
			sort.Strings(mk)
			for _, k := range mk {
				if walkJSON(c, fd.MapValue().Message(), fmt.Sprintf("%s[%q]", path, k), m[k]) {
					changed = true
				}
			}
		case fd.IsList():
			l, _ := val.([]any)
			if fd.Kind() != protoreflect.MessageKind {
				continue
			}
			for i, e := range l {
				if walkJSON(c, fd.Message(), fmt.Sprintf("%s[%d]", path, i), e) {
					changed = true
				}
			}
		case fd.Kind() == protoreflect.MessageKind && fd.Message().FullName() == fieldMaskName:
			if s, ok := val.(string); ok && strings.Contains(s, "_") {
				obj[k] = maskToJSONNames(s)
				changed = true
			}
		case fd.Kind() == protoreflect.MessageKind:
			if walkJSON(c, fd.Message(), path, val) {
				changed = true
			}
		}
	}
	return changed
}

// maskToJSONNames turns the comma-separated paths of a JSON field mask
// from proto names to JSON names ("limits.rpm_limit" → "limits.rpmLimit").
func maskToJSONNames(s string) string {
	paths := strings.Split(s, ",")
	for i, p := range paths {
		segs := strings.Split(p, ".")
		for j, seg := range segs {
			segs[j] = lowerCamel(seg)
		}
		paths[i] = strings.Join(segs, ".")
	}
	return strings.Join(paths, ",")
}

func lowerCamel(s string) string {
	var b strings.Builder
	up := false
	for _, r := range s {
		switch {
		case r == '_':
			up = true
		case up && r >= 'a' && r <= 'z':
			b.WriteRune(r - 'a' + 'A')
			up = false
		default:
			b.WriteRune(r)
			up = false
		}
	}
	return b.String()
}

// checkUnknown refuses a decoded message holding unknown fields anywhere
// (binary protobuf keeps them instead of failing), naming each by its
// path and field number.
func checkUnknown(m proto.Message) error {
	c := &validator{}
	walkUnknown(c, "", m.ProtoReflect())
	return c.err()
}

func walkUnknown(c *validator, path string, m protoreflect.Message) {
	for b := m.GetUnknown(); len(b) > 0; {
		num, _, n := protowire.ConsumeField(b)
		if n < 0 {
			break
		}
		b = b[n:]
		name := path
		if name == "" {
			name = "(request)"
		}
		c.add(name, "unknown field number %d (not a field of %s)", num, m.Descriptor().Name())
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		p := string(fd.Name())
		if path != "" {
			p = path + "." + p
		}
		switch {
		case fd.IsMap():
			if fd.MapValue().Kind() == protoreflect.MessageKind {
				v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
					walkUnknown(c, fmt.Sprintf("%s[%q]", p, printable(k.String())), mv.Message())
					return true
				})
			}
		case fd.IsList():
			if fd.Kind() == protoreflect.MessageKind {
				for i := 0; i < v.List().Len(); i++ {
					walkUnknown(c, fmt.Sprintf("%s[%d]", p, i), v.List().Get(i).Message())
				}
			}
		case fd.Kind() == protoreflect.MessageKind:
			walkUnknown(c, p, v.Message())
		}
		return true
	})
}

// checkOrgLimitsMask refuses an org update touching the org's limits or
// budget ("limits", "limits.max_budget", …) unless the caller holds a
// platform token: an org's limits bound what the platform lends it, so
// an org admin raising them is a platform decision. Org tokens still
// update their org's name and metadata, and set limits below the org on
// teams, members, users, keys and customers.
func checkOrgLimitsMask(ctx context.Context, mask *fieldmaskpb.FieldMask) error {
	md := (&adminv1.Org{}).ProtoReflect().Descriptor()
	for _, path := range mask.GetPaths() {
		if protoNames(md, strings.Split(path, "."))[0] == "limits" {
			return authz.Check(ctx, principal(ctx), authz.Write, authz.PlatformTarget("changing an org's limits or budget"))
		}
	}
	return nil
}
