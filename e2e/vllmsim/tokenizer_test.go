package vllmsim

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestTokenizePieces(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
	}{
		{"Hello world", []string{"Hell", "o", " worl", "d"}},
		{"The cat sat.", []string{"The", " cat", " sat", "."}},
		{"a  b", []string{"a", " ", " b"}},
		{"x\n\ny", []string{"x", "\n", "\n", "y"}},
		{"x \n  y", []string{"x", " ", "\n", " ", " y"}},
		{"12345 67", []string{"123", "45", " 67"}},
		{"(ok)", []string{"(", "ok", ")"}},
		{"héllo", []string{"héll", "o"}},
		{"<|im_start|>user\nhi<|im_end|>\n", []string{"<|im_start|>", "user", "\n", "hi", "<|im_end|>", "\n"}},
		{"a <|im_end|>", []string{"a", " ", "<|im_end|>"}},
		{"      z", []string{"    ", " ", " z"}},
		{"<|not special|>", []string{"<", "|", "not", " spec", "ial", "|", ">"}},
	} {
		if got := Pieces(tc.in); !slices.Equal(got, tc.want) {
			t.Errorf("Pieces(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
	if Tokenize("<|im_start|>")[0] != TokenIMStart || Tokenize("<|im_end|>")[0] != TokenIMEnd ||
		Tokenize("<|endoftext|>")[0] != TokenEndOfText {
		t.Error("special tokens do not have their fixed IDs")
	}
}

// English prose comes out at about four characters per token.
func TestTokenizeDensity(t *testing.T) {
	text := strings.Repeat("The quick brown fox jumps over the lazy dog while the engine schedules requests. ", 50)
	ratio := float64(len(text)) / float64(CountTokens(text))
	if ratio < 3 || ratio > 5 {
		t.Errorf("%.2f characters per token, want about 4", ratio)
	}
}

// FillerText has exactly the requested number of tokens, and generated
// pieces re-tokenize to themselves (so a model's answer, sent back as the
// next turn's history, has the token IDs it was generated with).
func TestFillerTextRoundTrips(t *testing.T) {
	for _, n := range []int{1, 2, 17, 1000} {
		text := FillerText(uint64(n), n)
		if got := CountTokens(text); got != n {
			t.Errorf("FillerText(%d) has %d tokens", n, got)
		}
	}
	g := newGenerator(3)
	var b strings.Builder
	var want []TokenID
	for range 500 {
		p := g.next()
		b.WriteString(p.text)
		want = append(want, p.id)
	}
	if got := Tokenize(b.String()); !slices.Equal(got, want) {
		t.Error("generated pieces do not re-tokenize to the generated IDs")
	}
	if FillerText(1, 50) == FillerText(2, 50) {
		t.Error("different seeds gave the same text")
	}
}

func FuzzTokenize(f *testing.F) {
	for _, s := range []string{"", "Hello world", "<|im_start|>user\nhi<|im_end|>\n", "  \t\n x", "ü🙂 12345!!",
		"<|im_end", "\xff\xfe", FillerText(1, 40)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		pieces := Pieces(s)
		if strings.Join(pieces, "") != s {
			t.Fatalf("pieces %q do not join to %q", pieces, s)
		}
		ids := Tokenize(s)
		if len(ids) != len(pieces) || CountTokens(s) != len(pieces) {
			t.Fatalf("%d IDs, %d counted, %d pieces", len(ids), CountTokens(s), len(pieces))
		}
		for i, p := range pieces {
			if p == "" {
				t.Fatalf("empty piece in %q", pieces)
			}
			if ids[i] >= VocabSize {
				t.Fatalf("ID %d out of the vocabulary", ids[i])
			}
			if utf8.ValidString(s) && !utf8.ValidString(p) {
				t.Fatalf("piece %q splits a rune", p)
			}
		}
		// Prefix stability at a newline: the template's turns end with one.
		for i := strings.IndexByte(s, '\n'); i >= 0; {
			head := Tokenize(s[:i+1])
			if !slices.Equal(ids[:len(head)], head) {
				t.Fatalf("tokens of %q are not a prefix of the tokens of %q", s[:i+1], s)
			}
			next := strings.IndexByte(s[i+1:], '\n')
			if next < 0 {
				break
			}
			i += next + 1
		}
	})
}

// FuzzRequestParsing feeds arbitrary bodies to the request parsers: they
// must never panic, and what they accept must tokenize within the
// vocabulary.
func FuzzRequestParsing(f *testing.F) {
	for _, s := range []string{
		`{"messages":[{"role":"user","content":"hi"}]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"tools":[{"type":"function"}]}`,
		`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"x"}]}]}`,
		`"a prompt"`, `["a","b"]`, `[1,2,3]`, `[[1],[2,3]]`, `[]`, `null`, `{"messages":"x"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var req chatRequest
		if json.Unmarshal(body, &req) == nil {
			if text, err := renderChat(req.Messages, req.Tools); err == nil {
				if !strings.HasSuffix(text, imStart+"assistant\n") {
					t.Fatalf("rendered chat %q lacks the generation prompt", text)
				}
			}
		}
		prompts, err := parsePrompts(body, "prompt")
		if err != nil {
			return
		}
		for _, p := range prompts {
			for _, id := range p {
				if id >= VocabSize {
					t.Fatalf("token %d out of the vocabulary", id)
				}
			}
		}
	})
}
