package service

import (
	"fmt"
	"strconv"

	"github.com/limitmesh/limitmesh/internal/wire"
	"github.com/limitmesh/limitmesh/mesh/internal/fail"
)

// The strict decoder's JSON parser: RFC 8259 into a tree of jsonValue
// (the scanning is internal/wire's), nothing more (request_strict.go applies the contract's rules to the
// tree).

// jsonKind is the type of a JSON value.
type jsonKind uint8

const (
	jsonNull jsonKind = iota
	jsonBool
	jsonNumber
	jsonString
	jsonArray
	jsonObject
)

// String names the kind with its article, for error messages ("is an array").
func (k jsonKind) String() string {
	return [...]string{"null", "a boolean", "a number", "a string", "an array", "an object"}[k]
}

// jsonValue is a parsed JSON value.
type jsonValue struct {
	kind jsonKind
	// str is a string's unescaped bytes or a number's text.
	str string
	// escaped: the string was written with at least one escape.
	escaped bool
	// badUTF8: the string is not valid UTF-8 after unescaping (an invalid
	// byte or an unpaired surrogate escape); str then holds the invalid
	// bytes as they came and U+FFFD for each unpaired surrogate.
	badUTF8 bool
	boolean bool
	members []jsonMember // an object's members, in order
	elems   []jsonValue  // an array's elements
}

// jsonMember is one name-value pair of an object.
type jsonMember struct {
	name  jsonValue // a string
	value jsonValue
}

// jsonParser builds the tree of a JSON text (RFC 8259) read with a
// wire.Scanner, nesting at most MaxRequestDepth levels.
type jsonParser struct {
	s wire.Scanner
}

// parseJSON parses b as one JSON value surrounded by optional white space.
// Its errors wrap fail.ErrBadRequest and give the byte offset. The
// strings of the tree share one copy of b.
func parseJSON(b []byte) (jsonValue, error) {
	p := &jsonParser{s: wire.Scanner{Text: string(b)}}
	v, err := p.value(1)
	if err == nil {
		err = p.s.End()
	}
	if err != nil {
		return v, fmt.Errorf("%w: %v", fail.ErrBadRequest, err)
	}
	return v, nil
}

// value parses the value at the cursor, which is at nesting level depth if
// it is an object or an array.
func (p *jsonParser) value(depth int) (jsonValue, error) {
	s := &p.s
	switch c := s.Peek(); {
	case c == '{' || c == '[':
		if depth > MaxRequestDepth {
			return jsonValue{}, &wire.SyntaxError{Offset: s.Pos, Msg: "nested deeper than " + strconv.Itoa(MaxRequestDepth) + " levels"}
		}
		s.Pos++
		if c == '{' {
			return p.object(depth)
		}
		return p.array(depth)
	case c == '"':
		return p.string()
	case c == '-' || c >= '0' && c <= '9':
		text, err := s.Number()
		return jsonValue{kind: jsonNumber, str: text}, err
	case c == 't':
		return jsonValue{kind: jsonBool, boolean: true}, s.ExpectLiteral("true")
	case c == 'f':
		return jsonValue{kind: jsonBool}, s.ExpectLiteral("false")
	case c == 'n':
		return jsonValue{kind: jsonNull}, s.ExpectLiteral("null")
	}
	return jsonValue{}, s.Unexpected()
}

// object parses the members of an object after its '{'.
func (p *jsonParser) object(depth int) (jsonValue, error) {
	v := jsonValue{kind: jsonObject}
	for first := true; ; first = false {
		more, err := p.s.More('}', first)
		if err != nil || !more {
			return v, err
		}
		name, err := p.string()
		if err != nil {
			return v, err
		}
		if err := p.s.Expect(':'); err != nil {
			return v, err
		}
		val, err := p.value(depth + 1)
		if err != nil {
			return v, err
		}
		v.members = append(v.members, jsonMember{name: name, value: val})
	}
}

// array parses the elements of an array after its '['.
func (p *jsonParser) array(depth int) (jsonValue, error) {
	v := jsonValue{kind: jsonArray}
	for first := true; ; first = false {
		more, err := p.s.More(']', first)
		if err != nil || !more {
			return v, err
		}
		e, err := p.value(depth + 1)
		if err != nil {
			return v, err
		}
		v.elems = append(v.elems, e)
	}
}

// string parses a string. Invalid UTF-8 and unpaired surrogates are not a
// syntax error (they set badUTF8), so the caller can name the field they
// are in.
func (p *jsonParser) string() (jsonValue, error) {
	str, flags, err := p.s.String()
	return jsonValue{kind: jsonString, str: str, escaped: flags&wire.Escaped != 0, badUTF8: flags&wire.InvalidUTF8 != 0}, err
}
