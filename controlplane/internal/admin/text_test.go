package admin

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// textField is one string reachable in a request message: its path as
// checkText names it, and how to set it.
type textField struct {
	path string
	set  func(m protoreflect.Message, s string)
}

// textFields lists every string of md (fields, list elements, map keys
// and values, nested messages except well-known types), from the
// descriptor alone.
func textFields(md protoreflect.MessageDescriptor, prefix string, depth int) []textField {
	if depth > 4 {
		return nil
	}
	var out []textField
	for i := 0; i < md.Fields().Len(); i++ {
		fd := md.Fields().Get(i)
		path := string(fd.Name())
		if prefix != "" {
			path = prefix + "." + path
		}
		switch {
		case fd.IsMap():
			if fd.MapKey().Kind() == protoreflect.StringKind {
				out = append(out, textField{path + `[key "x\x00"]`, func(m protoreflect.Message, s string) {
					mv := m.Mutable(fd).Map()
					mv.Set(protoreflect.ValueOfString("x\x00").MapKey(), mv.NewValue())
				}})
			}
			if fd.MapValue().Kind() == protoreflect.StringKind {
				out = append(out, textField{path + `["k"]`, func(m protoreflect.Message, s string) {
					m.Mutable(fd).Map().Set(protoreflect.ValueOfString("k").MapKey(), protoreflect.ValueOfString(s))
				}})
			}
		case fd.IsList() && fd.Kind() == protoreflect.StringKind:
			out = append(out, textField{path + "[1]", func(m protoreflect.Message, s string) {
				l := m.Mutable(fd).List()
				l.Append(protoreflect.ValueOfString("ok"))
				l.Append(protoreflect.ValueOfString(s))
			}})
		case fd.IsList() && fd.Kind() == protoreflect.MessageKind:
			for _, sub := range textFields(fd.Message(), path+"[0]", depth+1) {
				out = append(out, textField{sub.path, func(m protoreflect.Message, s string) {
					l := m.Mutable(fd).List()
					e := l.NewElement()
					sub.set(e.Message(), s)
					l.Append(e)
				}})
			}
		case fd.Kind() == protoreflect.StringKind:
			out = append(out, textField{path, func(m protoreflect.Message, s string) { m.Set(fd, protoreflect.ValueOfString(s)) }})
		case fd.Kind() == protoreflect.MessageKind && !strings.HasPrefix(string(fd.Message().FullName()), "google.protobuf."):
			for _, sub := range textFields(fd.Message(), path, depth+1) {
				out = append(out, textField{sub.path, func(m protoreflect.Message, s string) { sub.set(m.Mutable(fd).Message(), s) }})
			}
		}
	}
	return out
}

// post sends body with the content type as the bootstrap admin and
// returns the Connect code and message.
func (b *bundle) post(procedure, contentType string, body []byte) (string, string) {
	b.t.Helper()
	req, err := http.NewRequest(http.MethodPost, b.url+procedure, bytes.NewReader(body))
	require.NoError(b.t, err)
	req.Header.Set("Content-Type", contentType)
	req.Header.Set("Authorization", "Bearer "+b.bootstrap)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(b.t, err)
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	require.NoError(b.t, err)
	if resp.StatusCode == http.StatusOK {
		return "ok", ""
	}
	var e struct{ Code, Message string }
	require.NoError(b.t, jsonUnmarshal(out, &e), "%s", out)
	return e.Code, e.Message
}

// TestNULInAnyTextFieldIsInvalidArgument sets each string of each admin
// RPC's request (enumerated from the descriptors, so a new RPC or field
// is covered without touching this test) to a value with a NUL, in
// Connect JSON and in binary protobuf: every one answers InvalidArgument
// naming the field, never reaching Postgres (which answered 500 before).
func TestNULInAnyTextFieldIsInvalidArgument(t *testing.T) {
	t.Parallel()
	b := setup(t)
	before := b.auditCount()
	fields, rpcs := 0, 0
	for _, r := range adminRPCs(t) {
		parts := strings.Split(strings.TrimPrefix(r.procedure, "/"), "/")
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(parts[0]))
		require.NoError(t, err)
		in := d.(protoreflect.ServiceDescriptor).Methods().ByName(protoreflect.Name(parts[1])).Input()
		mt, err := protoregistry.GlobalTypes.FindMessageByName(in.FullName())
		require.NoError(t, err)
		tf := textFields(in, "", 0)
		if len(tf) > 0 {
			rpcs++
		}
		for _, f := range tf {
			fields++
			m := mt.New()
			f.set(m, "a\x00b")
			js, err := protojson.Marshal(m.Interface())
			require.NoError(t, err)
			pb, err := proto.Marshal(m.Interface())
			require.NoError(t, err)
			for _, enc := range []struct {
				ctype string
				body  []byte
			}{{"application/json", js}, {"application/proto", pb}} {
				code, msg := b.post(r.procedure, enc.ctype, enc.body)
				require.Equal(t, "invalid_argument", code, "%s %s (%s): %s", r.procedure, f.path, enc.ctype, msg)
				require.Contains(t, msg, f.path+": must not contain NUL", "%s (%s) names the field", r.procedure, enc.ctype)
			}
		}
	}
	t.Logf("%d string fields of %d RPCs checked", fields, rpcs)
	require.Greater(t, rpcs, 50, "most admin RPCs take text")
	require.Equal(t, before, b.auditCount(), "nothing was changed")
}

// TestInvalidUTF8IsInvalidArgument: invalid UTF-8 never reaches Postgres
// either. The codecs find the field a failed decode tripped on (the
// protobuf libraries do not name it), in binary protobuf and in JSON;
// checkText names it for any message that got past a codec.
func TestInvalidUTF8IsInvalidArgument(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, tc := range []struct {
		procedure string
		m         proto.Message
		want      string
	}{
		{"/sluice.admin.v1.OrgService/CreateOrg", &adminv1.CreateOrgRequest{Name: "acme\xffcorp"}, "name: must be valid UTF-8"},
		{"/sluice.admin.v1.KeyService/CreateKey", &adminv1.CreateKeyRequest{OrgId: "org", Tags: []string{"ok", "tag-one\xc3"}}, "tags[1]: must be valid UTF-8"},
		{"/sluice.admin.v1.KeyService/CreateKey", &adminv1.CreateKeyRequest{Metadata: map[string]string{"k": "value-\xfe-1"}}, `metadata["k"]: must be valid UTF-8`},
		{"/sluice.admin.v1.KeyService/CreateKey", &adminv1.CreateKeyRequest{Metadata: map[string]string{"keyname\xff": "v"}}, `metadata[key "keyname`}, // binary: \xff; JSON: \uFFFD
		{"/sluice.admin.v1.KeyService/UpdateKey", &adminv1.UpdateKeyRequest{Key: &adminv1.Key{Id: "key_1", ModelGroupAliases: map[string]string{"a": "group-\xfe-b"}}},
			`key.model_group_aliases["a"]: must be valid UTF-8`},
		{"/sluice.admin.v1.TeamService/UpdateTeamMember", &adminv1.UpdateTeamMemberRequest{Member: &adminv1.TeamMember{TeamId: "t", UserId: "user_\xff1234"}},
			"member.user_id: must be valid UTF-8"},
	} {
		pb, js := encodeUnchecked(t, tc.m)
		code, msg := b.post(tc.procedure, "application/proto", pb)
		require.Equal(t, "invalid_argument", code, msg)
		require.Contains(t, msg, tc.want, "binary protobuf")
		code, msg = b.post(tc.procedure, "application/json", js)
		require.Equal(t, "invalid_argument", code, msg)
		require.Contains(t, msg, tc.want, "JSON %s", js)
	}
	// A lone surrogate escape is not a string at all: refused by the decoder.
	code, msg := b.post("/sluice.admin.v1.KeyService/CreateKey", "application/json", []byte(`{"org_id":"o","metadata":{"k":"\udc00"}}`))
	require.Equal(t, "invalid_argument", code, msg)
	require.Equal(t, int64(0), b.auditCount())

	for _, tc := range []struct {
		m    proto.Message
		want string
	}{
		{&adminv1.CreateOrgRequest{Name: "a\xffb"}, "name: must be valid UTF-8"},
		{&adminv1.CreateKeyRequest{Tags: []string{"ok", "tag-one\xc3"}}, "tags[1]: must be valid UTF-8"},
		{&adminv1.CreateKeyRequest{Metadata: map[string]string{"keyname\xff": "v"}}, `metadata[key "keyname\xff"]: must be valid UTF-8`},
		{&adminv1.UpdateKeyRequest{Key: &adminv1.Key{Metadata: map[string]string{"env": "\x00"}}}, `key.metadata["env"]: must not contain NUL`},
		{&adminv1.UpdateKeyRequest{Key: &adminv1.Key{ModelGroupAliases: map[string]string{"a": "group-\xfe-b"}}}, `key.model_group_aliases["a"]: must be valid UTF-8`},
	} {
		err := checkText(tc.m)
		require.Error(t, err, "%v", tc.m)
		require.Contains(t, err.Error(), tc.want)
	}
	require.NoError(t, checkText(&adminv1.CreateKeyRequest{Alias: "ünïcode ✓", Metadata: map[string]string{"k": "v"}}))
}

func TestTextFieldsEnumeratesNestedStrings(t *testing.T) {
	t.Parallel()
	var paths []string
	for _, f := range textFields((&adminv1.UpdateKeyRequest{}).ProtoReflect().Descriptor(), "", 0) {
		paths = append(paths, f.path)
	}
	for _, want := range []string{"key.id", "key.alias", "key.tags[1]", `key.metadata["k"]`, `key.metadata[key "x\x00"]`} {
		require.Contains(t, paths, want, fmt.Sprint(paths))
	}
}

// encodeUnchecked encodes m in binary protobuf and in JSON with the
// invalid UTF-8 left in its strings, as a client in another language
// could send it (the Go encoders refuse): each bad string is replaced by
// a unique placeholder of the same length, the clone encoded, and the
// placeholders swapped back in the bytes. Bad strings need 8+ bytes.
func encodeUnchecked(t *testing.T, m proto.Message) (pb, js []byte) {
	t.Helper()
	c := proto.Clone(m)
	var swaps [][2]string
	sub := func(s string) string {
		if utf8.ValidString(s) {
			return s
		}
		require.GreaterOrEqual(t, len(s), 8, "bad test strings need 8+ bytes: %q", s)
		p := fmt.Sprintf("~%0*d~", len(s)-2, len(swaps)+1)
		swaps = append(swaps, [2]string{p, s})
		return p
	}
	var fix func(pm protoreflect.Message)
	fix = func(pm protoreflect.Message) {
		pm.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
			switch {
			case fd.IsMap():
				mp := v.Map()
				var keys []protoreflect.MapKey
				mp.Range(func(k protoreflect.MapKey, _ protoreflect.Value) bool {
					keys = append(keys, k)
					return true
				})
				for _, k := range keys {
					val := mp.Get(k)
					mp.Clear(k)
					if fd.MapKey().Kind() == protoreflect.StringKind {
						k = protoreflect.ValueOfString(sub(k.String())).MapKey()
					}
					if fd.MapValue().Kind() == protoreflect.StringKind {
						val = protoreflect.ValueOfString(sub(val.String()))
					}
					mp.Set(k, val)
				}
			case fd.IsList() && fd.Kind() == protoreflect.StringKind:
				l := v.List()
				for i := 0; i < l.Len(); i++ {
					l.Set(i, protoreflect.ValueOfString(sub(l.Get(i).String())))
				}
			case fd.Kind() == protoreflect.StringKind:
				pm.Set(fd, protoreflect.ValueOfString(sub(v.String())))
			case fd.Kind() == protoreflect.MessageKind && !fd.IsList():
				fix(v.Message())
			}
			return true
		})
	}
	fix(c.ProtoReflect())
	pb, err := proto.Marshal(c)
	require.NoError(t, err)
	js, err = protojson.Marshal(c)
	require.NoError(t, err)
	for _, sw := range swaps {
		require.Equal(t, 1, bytes.Count(pb, []byte(sw[0])), "placeholder %q unique", sw[0])
		pb = bytes.Replace(pb, []byte(sw[0]), []byte(sw[1]), 1)
		js = bytes.Replace(js, []byte(sw[0]), []byte(sw[1]), 1)
	}
	return pb, js
}
