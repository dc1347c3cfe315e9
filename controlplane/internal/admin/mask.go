package admin

import (
	"encoding/base64"
	"strings"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
)

// applyMask copies the fields named by mask from src into dst. allowed
// lists the top-level fields that may be updated; a nested path
// ("limits.rpm_limit") is allowed when its top-level field is. Every bad
// path is reported as InvalidArgument naming it.
func applyMask(dst, src proto.Message, mask *fieldmaskpb.FieldMask, allowed ...string) error {
	c := &validator{}
	if mask == nil || len(mask.GetPaths()) == 0 {
		return invalid("update_mask", "required: name the fields to update (e.g. %s)", strings.Join(allowed, ", "))
	}
	ok := map[string]bool{}
	for _, a := range allowed {
		ok[a] = true
	}
	for _, path := range mask.GetPaths() {
		// Proto ("limits.rpm_limit") and JSON ("limits.rpmLimit") names
		// both name a field.
		parts := protoNames(dst.ProtoReflect().Descriptor(), strings.Split(path, "."))
		if !ok[parts[0]] {
			c.add("update_mask", "field %q cannot be updated (updatable: %s)", path, strings.Join(allowed, ", "))
			continue
		}
		d, s := dst.ProtoReflect(), src.ProtoReflect()
		for i, name := range parts {
			fd := d.Descriptor().Fields().ByName(protoreflect.Name(name))
			if fd == nil {
				c.add("update_mask", "unknown field %q", path)
				break
			}
			if i == len(parts)-1 {
				if s.Has(fd) {
					d.Set(fd, s.Get(fd))
				} else {
					d.Clear(fd)
				}
				break
			}
			if fd.Kind() != protoreflect.MessageKind || fd.IsList() || fd.IsMap() {
				c.add("update_mask", "field %q has no subfields", strings.Join(parts[:i+1], "."))
				break
			}
			d = d.Mutable(fd).Message()
			if s.Has(fd) {
				s = s.Get(fd).Message()
			} else {
				s = d.Type().New() // empty source: clears the leaf
			}
		}
	}
	return c.err()
}

// Page sizes.
const (
	defaultPageSize = 50
	maxPageSize     = 500
)

// pageArgs validates page_size and page_token and returns the limit and
// the position after which the page starts.
func pageArgs(size int32, tok string) (limit int, after string, err error) {
	c := &validator{}
	switch {
	case size < 0:
		c.add("page_size", "must not be negative")
	case size == 0:
		limit = defaultPageSize
	case size > maxPageSize:
		c.add("page_size", "must be at most %d (got %d)", maxPageSize, size)
	default:
		limit = int(size)
	}
	if tok != "" {
		b, derr := base64.RawURLEncoding.DecodeString(tok)
		if derr != nil || len(b) == 0 || len(b) > 200 {
			c.add("page_token", "not a token from a previous page")
		}
		after = string(b)
	}
	return limit, after, c.err()
}

// nextPageToken returns the token for the page after last, or "" when n
// rows (fewer than limit) mean there is no next page.
func nextPageToken(n, limit int, last string) string {
	if n < limit || last == "" {
		return ""
	}
	return base64.RawURLEncoding.EncodeToString([]byte(last))
}

// protoNames maps each segment of a mask path, given by its proto or its
// JSON name, to the proto name of the field it names in md (and the
// messages below); a segment naming no field is kept as given, for the
// caller to report.
func protoNames(md protoreflect.MessageDescriptor, parts []string) []string {
	out := make([]string, len(parts))
	for i, p := range parts {
		out[i] = p
		if md == nil {
			continue
		}
		fd := md.Fields().ByName(protoreflect.Name(p))
		if fd == nil {
			fd = md.Fields().ByJSONName(p)
		}
		if fd == nil {
			md = nil
			continue
		}
		out[i] = string(fd.Name())
		if fd.Kind() == protoreflect.MessageKind && !fd.IsList() && !fd.IsMap() {
			md = fd.Message()
		} else {
			md = nil
		}
	}
	return out
}
